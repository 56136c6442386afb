"""examples/scripts/build_deep_gemm.sh on a machine without a GPU: arguments, checks, dry run, and the build flow.

The build itself needs a CUDA torch and nvcc (the GPU run builds and smoke-tests a real wheel); here a stand-in
Python answers the torch probe and plays pip (it records what it was asked to build and install), and a stand-in
toolkit folder provides nvcc and the headers the script looks for. Everything else the script does runs for real:
option parsing, the checks, unpacking a source archive, patching setup.py, and the install step it chooses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "scripts" / "build_deep_gemm.sh"

FAKE_PYTHON = """#!/usr/bin/env bash
# Stand-in for a CUDA Python: answers the build script's torch probe and plays pip; anything else runs for real.
if [[ "$1" == -c && "$2" == *torch.version.cuda* ]]; then echo "3.12.3 2.11.0+cu130 {torch_cuda} 0"; exit 0; fi
if [[ "$1" == -c && "$2" == *"import nvidia"* ]]; then exit 1; fi
if [[ "$1" == -c && "$2" == *wheel.bdist_wheel* ]]; then exit 0; fi
if [[ "$1" == -m && "$2" == pip && "$3" == --version ]]; then echo "pip 25.0"; exit 0; fi
if [[ "$1" == -m && "$2" == pip && "$3" == wheel ]]; then
  shift 3; out=""
  while [[ $# -gt 0 ]]; do [[ "$1" == -w ]] && out=$2; shift; done
  cp setup.py "$out/setup_seen.py"
  touch "$out/deep_gemm-2.6.1-cp312-cp312-linux_x86_64.whl"; exit 0
fi
if [[ "$1" == -m && "$2" == pip && "$3" == install ]]; then echo "$@" >> "{log}"; exit 0; fi
exec "{real}" "$@"
"""


def _toolkit(tmp: Path) -> Path:
    """A folder shaped like a CUDA toolkit, as far as the script looks (nvcc's version line, headers, libs)."""
    cuda = tmp / "cuda"
    (cuda / "bin").mkdir(parents=True)
    nvcc = cuda / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.48'\n")
    nvcc.chmod(0o755)
    for h in ("cuda.h", "cuda_runtime.h", "nvrtc.h", "cublasLt.h", "cublas_v2.h", "cusparse.h", "cusolverDn.h",
              "cccl/cuda/std/utility"):
        (cuda / "include" / h).parent.mkdir(parents=True, exist_ok=True)
        (cuda / "include" / h).write_text("")
    (cuda / "lib64").mkdir()
    for lib in ("libcudart.so", "libnvrtc.so"):
        (cuda / "lib64" / lib).write_text("")
    return cuda


def _python(tmp: Path, torch_cuda: str = "13.0") -> tuple[Path, Path]:
    log = tmp / "pip_install.log"
    py = tmp / "python-stand-in"
    py.write_text(FAKE_PYTHON.format(torch_cuda=torch_cuda, log=log, real=sys.executable))
    py.chmod(0o755)
    return py, log


def _archive(tmp: Path, std: str = "c++17") -> Path:
    """A source archive in deep_gemm_pack.sh's layout (top folder, setup.py, third-party includes)."""
    top = tmp / "src" / "deepgemm-src"
    for d in ("csrc", "deep_gemm", "third-party/cutlass/include/cute", "third-party/fmt/include/fmt"):
        (top / d).mkdir(parents=True, exist_ok=True)
    (top / "setup.py").write_text(f"cxx_flags = ['-std={std}', '-O3']\n")
    (top / "DG_SOURCE.txt").write_text("packed for a test\ndeepseek-ai/DeepGEMM 54e22612 (test)\n")
    out = tmp / "deepgemm-src.tar.gz"
    with tarfile.open(out, "w:gz") as tar:
        tar.add(top, arcname="deepgemm-src")
    return out


def _run(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "CUDA_HOME"}
    full.update(env or {})
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=full, cwd=cwd, timeout=120)


def test_help_and_bad_arguments():
    r = _run("--help")
    assert r.returncode == 0 and "--source" in r.stdout and "--dry-run" in r.stdout
    r = _run("--bogus")
    assert r.returncode == 2 and r.stderr.strip() == "build_deep_gemm: error: unknown option '--bogus'; see --help"
    r = _run("--source")
    assert r.returncode == 2 and "--source needs a value" in r.stderr
    r = _run("--install", "--target", "/tmp/x")
    assert r.returncode == 2 and "exclude each other" in r.stderr
    r = _run("--ref", "not-a-commit")
    assert r.returncode == 2 and "--ref must be a commit hash" in r.stderr


def test_dry_run_names_every_missing_requirement(tmp_path):
    py, _ = _python(tmp_path, torch_cuda="None")
    r = _run("--dry-run", "--python", str(py), "--source", str(tmp_path / "nowhere"), "--wheel-dir", str(tmp_path / "dist"),
             env={"CUDA_HOME": str(tmp_path / "no-cuda"), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 1
    missing = r.stderr.strip().splitlines()
    assert len(missing) == 1 and missing[0].startswith("build_deep_gemm: missing: ")
    for what in ("--source", "a CUDA build of torch", "a CUDA toolkit"):
        assert what in missing[0], (what, missing[0])
    assert not (tmp_path / "dist").exists(), "a dry run creates nothing"


def test_dry_run_ready_with_an_archive(tmp_path):
    py, log = _python(tmp_path)
    archive = _archive(tmp_path)
    r = _run("--dry-run", "--python", str(py), "--source", str(archive), "--install",
             env={"CUDA_HOME": str(_toolkit(tmp_path))})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ready to build" in r.stdout and "deepseek-ai/DeepGEMM 54e22612" in r.stdout and "nvcc 13.0" in r.stdout
    assert "install:" in r.stdout and not log.exists()


def test_a_file_that_is_no_source_archive_is_refused(tmp_path):
    py, _ = _python(tmp_path)
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"not a tarball")
    r = _run("--dry-run", "--python", str(py), "--source", str(bad), env={"CUDA_HOME": str(_toolkit(tmp_path))})
    assert r.returncode == 1 and "deep_gemm_pack.sh" in r.stderr


def test_build_flow_unpacks_patches_builds_and_installs(tmp_path):
    py, log = _python(tmp_path)
    archive = _archive(tmp_path)
    dist, target, work = tmp_path / "dist", tmp_path / "site", tmp_path / "work"
    r = _run("--python", str(py), "--source", str(archive), "--wheel-dir", str(dist), "--target", str(target),
             "--work", str(work), env={"CUDA_HOME": str(_toolkit(tmp_path)), "DG_PATCH_REGEX": "0"})
    assert r.returncode == 0, r.stdout + r.stderr
    wheels = list(dist.glob("deep_gemm-*.whl"))
    assert len(wheels) == 1
    assert "-std=c++20" in (dist / "setup_seen.py").read_text(), "setup.py's C++ standard is raised to c++20"
    installed = log.read_text()
    assert f"--target {target}" in installed and str(wheels[0]) in installed and "--no-deps" in installed
    assert "no GPU here, smoke test skipped" in r.stdout
    env = (target / "deep_gemm_env.sh").read_text()
    assert f"export CUDA_HOME='{tmp_path / 'cuda'}'" in env and str(target) in env
    check = subprocess.run(["bash", "-c", f"source {target / 'deep_gemm_env.sh'}; source {target / 'deep_gemm_env.sh'}; "
                            "echo $PYTHONPATH"], capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    assert check.stdout.strip() == str(target), "sourcing the env file twice adds the folder once"
    assert (work / "deepgemm-src" / "setup.py").exists(), "--work keeps the unpacked source"


def test_setup_py_left_alone_when_asked_for_cxx17(tmp_path):
    py, _ = _python(tmp_path)
    dist = tmp_path / "dist"
    r = _run("--python", str(py), "--source", str(_archive(tmp_path)), "--wheel-dir", str(dist),
             env={"CUDA_HOME": str(_toolkit(tmp_path)), "DG_PATCH_REGEX": "0", "DG_CXX_STD": "c++17"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "-std=c++17" in (dist / "setup_seen.py").read_text()
    assert "pip install --no-deps" in r.stdout  # no install asked: the script says how


def test_regex_patch_replaces_the_three_uses_and_names_a_missing_one(tmp_path):
    sys.path.insert(0, str(ROOT / "examples" / "scripts"))
    import deep_gemm_no_regex as nr

    src = tmp_path / "DeepGEMM"
    for rel in {rel for rel, _, _ in nr.PATCHES}:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text("// head\n" + "\n// between\n".join(old for r, old, _ in nr.PATCHES if r == rel) + "\n// tail\n")
    run = [sys.executable, str(ROOT / "examples" / "scripts" / "deep_gemm_no_regex.py"), str(src)]
    assert subprocess.run(run, capture_output=True, text=True).returncode == 0
    for rel, old, new in nr.PATCHES:
        text = (src / rel).read_text()
        assert new in text and old not in text and text.startswith("// head\n") and text.endswith("// tail\n")
    assert "std::regex" not in "".join((src / rel).read_text() for rel, _, _ in nr.PATCHES).replace("without std::regex", "")
    again = subprocess.run(run, capture_output=True, text=True)  # already patched: the code it expects is gone
    assert again.returncode == 1 and again.stderr.strip().count("\n") == 0 and "include_parser.hpp: expected code not found" in again.stderr
