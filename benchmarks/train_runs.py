"""Training runs as a user starts them, for the end-to-end benchmarks: one `train_ppo_ray` run per process.

Each run is `deepspeed --num_gpus 1 openrlhf/cli/train_ppo_ray.py ARGV --ckpt.output_dir OUT` in its own process
group, logging to `OUT/log.txt`; `finish` waits for it (or stops it at its time limit) and reads what the trainer
wrote: `metrics.jsonl` (one line per step, kept when a run is stopped early) and `summary.json`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from jetrl_precision.gemm.vendor_route import route_setting
from openrlhf.utils.network import free_port  # re-exported: the drivers import it from here

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["cuda", "launcher", "run_env", "free_port", "start", "finish", "engine_compile", "wait_engine_ready", "env_info"]


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def launcher() -> list[str]:
    """The deepspeed launcher: the `deepspeed` script when on PATH, else the module it runs."""
    exe = shutil.which("deepspeed")
    return [exe] if exe else [sys.executable, "-m", "deepspeed.launcher.runner"]


def run_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # FlashInfer is not carried to the lent GPU
    env.setdefault("PYTHONUNBUFFERED", "1")
    for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        env.setdefault(k, "0" if k == "NCCL_NVLS_ENABLE" else "1")
    if not cuda():  # CPU: DeepSpeed over gloo, vLLM-CPU in fp32 with a small KV cache
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    return env


def start(argv: list[str], out: Path, port: int, env_overrides: dict[str, str] | None = None) -> dict:
    """Launch one training run (its own process group); `env_overrides` are set in its environment on top of
    `run_env()` and kept in the result (`env_overrides`)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [*launcher(), "--num_gpus", "1", "--master_port", str(port), str(ROOT / "openrlhf/cli/train_ppo_ray.py"), *argv,
           "--ckpt.output_dir", str(out)]
    if not cuda():
        cmd += ["--ds.param_dtype", "fp32"]
    (out / "cmd.json").write_text(json.dumps(cmd, indent=1))
    log = open(out / "log.txt", "w")
    env = {**run_env(), **(env_overrides or {})}
    # The cuBLASLt route (CUDA only) changes which kernels the bitwise mode runs: results say whether it was on.
    route = "probe" if cuda() and route_setting(env) else "off"
    # Its own process group: a timeout takes the launcher's worker down too (or it would hold the port and GPU).
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return {"proc": proc, "log": log, "out": out, "t0": time.time(), "vendor_route": route, "env_overrides": dict(env_overrides or {})}


def finish(job: dict, timeout: float) -> dict:
    proc, out = job["proc"], job["out"]
    timed_out = False
    try:
        proc.wait(timeout=max(1.0, timeout - (time.time() - job["t0"])))
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    job["log"].close()
    for f in [*out.glob("*.safetensors"), *out.glob("*.bin")]:  # the run's final model export: not a result, GBs at 8B
        f.unlink()
    steps = []
    if (out / "metrics.jsonl").exists():
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    log = (out / "log.txt").read_text(errors="replace")
    res = {"rc": proc.returncode, "timed_out": timed_out, "wall_s": round(time.time() - job["t0"], 1), "steps": steps,
           "precision_report": summary.get("precision_report", ""), "engine": summary.get("engine"),
           "vendor_route": job.get("vendor_route", ""), "engine_compile": engine_compile(log),
           "env_overrides": job.get("env_overrides", {})}
    if proc.returncode != 0:
        res["log_tail"] = log[-3000:]
    return res


def engine_compile(log: str) -> str:
    """How the run's vLLM engine got its compiled model, from vLLM's log lines: 'aot-loaded' (torch's AOT artifact
    from an earlier start), 'cache-loaded' (Inductor's cached graphs, traced again), 'compiled' (vLLM compiled it: cold, or with only Inductor's cache warm), or ''.
    Results keep it so that warm and cold starts can be told apart (docs/vllm.md)."""
    if "Directly load AOT compilation" in log:
        return "aot-loaded"
    if "Directly load the compiled graph" in log:
        return "cache-loaded"
    if "Compiling a graph for" in log:
        return "compiled"
    return ""


def wait_engine_ready(job: dict, timeout: float) -> None:
    """Until the run's vLLM engine is up (its log says so), it exits, or `timeout` passes. vLLM sizes its KV cache
    from the free memory it sees while it profiles its start-up, so two engines must not profile at the same time.
    vLLM-CPU takes a fixed KV cache (VLLM_CPU_KVCACHE_SPACE) and profiles nothing: no wait there."""
    if not cuda():
        return
    t0 = time.time()
    while time.time() - t0 < timeout and job["proc"].poll() is None:
        if "vLLM engine ready" in (job["out"] / "log.txt").read_text(errors="replace"):
            return
        time.sleep(2.0)



def env_info() -> dict:
    """The machine and the versions of the stack. Versions come from the installed distributions (the one each
    import name resolves to first on sys.path, as an import would): importing vLLM and DeepSpeed only to read their
    versions costs seconds per call, and the runs themselves show whether they import."""
    from importlib import metadata

    import torch

    from headline import job_device  # benchmarks/

    info = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "python": sys.version.split()[0], "device": job_device()}
    dists = metadata.packages_distributions()  # import name -> distributions providing it (e.g. vllm -> vllm-cpu)
    for mod in ("vllm", "deepspeed", "transformers", "triton", "math_verify"):
        names = dists.get(mod)
        info[mod] = metadata.version(names[0]) if names else "missing (not installed)"
    return info

