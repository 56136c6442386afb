"""What the Ray GPU tests share: a tiny GRPO task (a 2-layer Llama with head_dim 64, prompts, a reward) built once per
module, the `train_ppo_ray` command line a user would type for it, and the run's per-step metrics.

Ray, vLLM and DeepSpeed come from `benchmarks/h200x2_ray.sh install` on the device (the image has none of them)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import grpo_vllm_gpu as g  # noqa: E402
from train_runs import run_env  # noqa: E402

__all__ = ["ROOT", "ENV", "missing_modules", "make_task", "argv", "cli", "metrics", "hybrid_run"]

ENV = {**run_env(), "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
for _k in ("WORLD_SIZE", "LOCAL_RANK", "RANK", "RAY_ADDRESS"):
    ENV.pop(_k, None)


def missing_modules() -> list[str]:
    return [m for m in ("ray", "vllm", "deepspeed") if importlib.util.find_spec(m) is None]


def make_task(d: Path) -> tuple:
    """(plan, model, data, reward) of a tiny GRPO run, built under `d`."""
    plan = g.SpeedPlan(layers=2, prompts=8, n=4, new_tokens=32, steps=2, rollout_micro=8, train_micro=8, gpu_mem=0.25,
                       gemm_backend="torch", tiny=True)
    model, data, reward = g.speed_inputs(d, plan)
    return plan, model, data, reward


def argv(task, out: Path, extra: list[str], steps: int = 2, new_tokens: int | None = None, model: Path | None = None) -> list[str]:
    plan, task_model, data, reward = task
    model = model or task_model
    plan = dataclasses.replace(plan, steps=steps, new_tokens=new_tokens or plan.new_tokens)
    args = [a for a in plan.argv(model, data, reward) if a != "--vllm.enable_sleep"]
    return [*args, "--algo.advantage.estimator", "group_norm", "--rollout.engine", "vllm", "--vllm.enforce_eager",
            "--train.eval_prompts", "0", "--fp8_unified", "--ckpt.output_dir", str(out), *extra]


def cli(args: list[str], timeout: float = 480) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "openrlhf.cli.train_ppo_ray", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def hybrid_run(task, out: Path, gpus: int, backend: str) -> tuple[dict, list[dict]]:
    """Ray's hybrid engine on `gpus` GPUs (as many policy ranks and engines, `--train.colocate_all
    --vllm.enable_sleep`, weight sync over `backend`): the run's layout and per-step metrics, once it exited 0."""
    p = cli(argv(task, out, ["--vllm.num_engines", str(gpus), "--actor.num_gpus_per_node", str(gpus), "--train.colocate_all",
                             "--vllm.enable_sleep", "--algo.kl.init_coef", "0", "--vllm.gpu_memory_utilization", "0.2",
                             "--vllm.sync_backend", backend]))
    assert p.returncode == 0, p.stderr[-4000:]
    layout = json.loads((out / "ray_layout.json").read_text())
    assert layout["on_gpu"] and layout["sync_backend"] == {"auto": "ipc"}.get(backend, backend), layout
    return layout, metrics(out)
