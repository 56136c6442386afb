"""Where a vLLM decode step's GPU time goes, kernel by kernel: bf16 against jet_fp8 (and jet_fp8+bitwise).

    python benchmarks/vllm_decode_profile.py --recipes bf16 jet_fp8 jet_fp8+bitwise --layers 8 --prompts 256 --out DIR
    python benchmarks/vllm_decode_profile.py --from DIR            # the table again, from the jobs' JSON
    python benchmarks/vllm_decode_profile.py --from DIR --record   # and file it in benchmarks/results/runs

Each recipe runs in its own process (vLLM keeps GPU memory until its process ends), one after another, or with
`--together` all alive at once, their timed sections in strict rotation (the card must hold every engine): a
Llama-3.1-8B-shaped engine (random weights, `--layers` layers; benchmarks/vllm_gpu.py's model) in vLLM's default
mode (torch.compile + CUDA graphs) or eager, warmed up, then profiled by torch.profiler twice: a generate of
`--prompts` prompts with one new token (prefill and one sample), and the same with 1 + `--steps` new tokens. The difference, per kernel, divided by
`--steps`, is what one decode step of that many sequences spends, prefill excluded; kernels launched inside CUDA-graph
replays are recorded by CUPTI like any other. Kernels are grouped by name (`CATEGORIES`: GEMM, activation quantizer,
attention, norm, rotary, SiLU*mul, sampler and log-probs, other), and the table puts the recipes side by side with
the wall time per decode step, under the profiler and without it (best of three), and where the step's host time
goes by Python function (`host_sampler.py`, a stack sampler). It answers what the throughput ratio alone cannot:
which part of the step FP8 makes faster or slower, whether the step waits on the host, and what the bitwise mode's
kernels cost.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from headline import job_device, recorded_device  # noqa: E402  (benchmarks/)
from host_sampler import StackSampler, per_step  # noqa: E402  (benchmarks/)
from openrlhf.utils.profiling import kernel_times  # noqa: E402  (torch only; no vLLM import)

__all__ = ["CATEGORIES", "category", "kernel_times", "decode_kernels", "summarize", "main"]

# First match wins: the attention and norm names come before the GEMM patterns some of them would also match.
CATEGORIES = (
    ("attention", r"attn|attention|flash|fmha|paged|reshape_and_cache|kv_cache"),
    ("norm", r"rms|norm|rsqrt"),
    ("rotary", r"rotary|rope"),
    ("silu*mul", r"silu|act_and_mul|swiglu"),
    ("sampler/log-probs", r"softmax|sampl|topk|top_k|argmax|logprob|gumbel|exponential|multinomial|argsort|sort"),
    ("quantize", r"quant"),
    ("gemm", r"gemm|gemv|cutlass|xmma|nvjet|matmul|scaled_mm|cublas|splitk|^_fp8_kernel$|^_bf16_kernel$|_sum_splits"),
)


def category(kernel: str, table: tuple[tuple[str, str], ...] = CATEGORIES) -> str:
    """The first group of `table` whose pattern the kernel's name matches, else "other"."""
    name = kernel.lower()
    for cat, pattern in table:
        if re.search(pattern, name):
            return cat
    return "other"


def decode_kernels(short: dict[str, float], long: dict[str, float], steps: int) -> dict[str, float]:
    """us per decode step per kernel: (long - short) / steps, kernels only in one profile counted as 0 in the other;
    small negatives (noise in kernels that both runs launch equally) are clipped to 0."""
    return {k: max(0.0, (long.get(k, 0.0) - short.get(k, 0.0)) / steps) for k in sorted(set(short) | set(long))}


def _generate(llm, prompts, max_tokens: int) -> float:
    """Wall seconds of one generate of `max_tokens` new tokens per prompt, the device drained before and after."""
    import torch
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, seed=0, detokenize=False)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    sync()
    return time.perf_counter() - t0


def _profile(llm, prompts, max_tokens: int) -> tuple[dict[str, float], float]:
    """(device us per kernel name, wall seconds) of one generate."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        wall = _generate(llm, prompts, max_tokens)
    return kernel_times(prof, cuda), wall


def _sampled(llm, prompts, max_tokens: int) -> StackSampler:
    with StackSampler() as s:
        _generate(llm, prompts, max_tokens)
    return s


def job(a: argparse.Namespace) -> dict:
    import vllm_gpu

    # --together: every recipe's engine is alive at once and their timed sections rotate (vllm_gpu.Rotation), so drift
    # in the host's speed falls on all recipes alike; alone, this engine has the GPU to itself anyway
    return vllm_gpu.in_rotation(a, _job)


def _job(a: argparse.Namespace, turn) -> dict:
    import torch

    from jetrl_precision import PrecisionGraph

    import vllm_gpu

    vllm_gpu.use_shape(a.tiny)
    engine = vllm_gpu.rollout_engine(a, a.prompt_len + a.steps + 16)
    prompts = vllm_gpu.random_prompts(torch.Generator().manual_seed(0), a.prompts, a.prompt_len)
    turn.arrive(a.recipe)
    with turn.take():
        _profile(engine.llm, prompts, 1 + a.steps)  # warm-up: graphs captured, kernels compiled and tuned
    with turn.take():
        short, wall_short = _profile(engine.llm, prompts, 1)
        long, wall_long = _profile(engine.llm, prompts, 1 + a.steps)
    # the same without the profiler (CUPTI adds host time per launch, and FP8 launches more), best of three: a
    # host-bound step's noise (other work on the host) only ever adds time
    bare: dict[int, float] = {}
    for _ in range(3):
        with turn.take():
            for n in (1, 1 + a.steps):
                bare[n] = min(bare.get(n, float("inf")), _generate(engine.llm, prompts, n))
    with turn.take():  # where the host time goes, by Python function (an eager step waits on it)
        s_short, s_long = _sampled(engine.llm, prompts, 1), _sampled(engine.llm, prompts, 1 + a.steps)
    meta = PrecisionGraph.from_dict(engine.precision_graph()).meta
    engine.shutdown()
    per_kernel = decode_kernels(short, long, a.steps)
    cats: dict[str, float] = {}
    for k, us in per_kernel.items():
        cats[category(k)] = cats.get(category(k), 0.0) + us
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:25]
    return {"job": "decode_profile", "recipe": a.recipe, "mode": a.mode, "layers": a.layers, "prompts": a.prompts,
            "prompt_len": a.prompt_len, "steps": a.steps, "kernels_captured": len(long),
            "decode_step_wall_us": round(1e6 * (wall_long - wall_short) / a.steps, 1),
            "decode_step_kernel_us": round(sum(per_kernel.values()), 1),
            "categories_us": {c: round(v, 2) for c, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "top_kernels_us": [[k, round(v, 2), category(k)] for k, v in top],
            "decode_step_wall_unprofiled_us": round(1e6 * (bare[1 + a.steps] - bare[1]) / a.steps, 1),
            "host_self_us": per_step(s_long.self_us(), s_short.self_us(), a.steps, 30),
            "host_cum_us": per_step(s_long.cum_us(), s_short.cum_us(), a.steps, 60),
            "host_samples": s_long.samples, "eager_linear_call": meta.get("eager_linear_call", ""),
            "gemm_call": meta.get("gemm_call", ""), "date": time.strftime("%Y-%m-%d"),
            "device": job_device()}


def summarize(results: list[dict]) -> str:
    if not results:
        return "no profiles"
    cats = [c for c, _ in CATEGORIES] + ["other"]
    head = "| per decode step (us) | " + " | ".join(f"{r['recipe']} ({r['mode']})" for r in results) + " |"
    lines = [f"{results[0]['prompts']} sequences, {results[0]['layers']} layers, prompt {results[0]['prompt_len']}, "
             f"{results[0]['steps']} decode steps profiled", "", head, "|---" * (len(results) + 1) + "|"]
    lines.append("| wall | " + " | ".join(f"{r['decode_step_wall_us']:.0f}" for r in results) + " |")
    if all("decode_step_wall_unprofiled_us" in r for r in results):
        lines.append("| wall, no profiler | " + " | ".join(f"{r['decode_step_wall_unprofiled_us']:.0f}" for r in results) + " |")
    lines.append("| GPU kernels, total | " + " | ".join(f"{r['decode_step_kernel_us']:.0f}" for r in results) + " |")
    for c in cats:
        if any(r["categories_us"].get(c) for r in results):
            lines.append(f"| {c} | " + " | ".join(f"{r['categories_us'].get(c, 0.0):.1f}" for r in results) + " |")
    for r in results:
        if not r["kernels_captured"]:
            lines.append(f"\n{r['recipe']}: the profiler recorded no GPU kernels (CUPTI unavailable?): its columns are empty")
        lines += ["", f"{r['recipe']} ({r['mode']}), top kernels per decode step:"]
        lines += [f"  {us:8.1f} us  {cat:17s} {name[:110]}" for name, us, cat in r["top_kernels_us"][:12]]
        if r.get("host_self_us"):
            lines += ["", f"{r['recipe']} ({r['mode']}), host time per decode step by Python line (innermost frame; "
                          f"eager linear call: {r.get('eager_linear_call') or 'n/a'}):"]
            lines += [f"  {us:8.1f} us  {key[:120]}" for key, us in r["host_self_us"][:15]]
            lines += ["", f"{r['recipe']} ({r['mode']}), host time per decode step by function (on the stack):"]
            lines += [f"  {us:8.1f} us  {key[:120]}" for key, us in r["host_cum_us"][:30]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", default=["bf16", "jet_fp8", "jet_fp8+bitwise"])
    ap.add_argument("--recipe", default=None, help=argparse.SUPPRESS)  # one job (the child process)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="default", choices=["default", "eager"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--gpu-mem", type=float, default=0.3)
    ap.add_argument("--kv-gib", type=float, default=12.0)
    ap.add_argument("--gemm-backend", default="torch", help="the plain recipes' FP8 GEMM (the bitwise one is always invariant)")
    ap.add_argument("--timeout", type=float, default=300.0, help="per recipe")
    ap.add_argument("--together", action="store_true",
                    help="every recipe's engine alive at once, their timed sections in rotation (the card must hold them all)")
    ap.add_argument("--sync-dir", default=None, help=argparse.SUPPRESS)  # --together: the rotation's folder (a child)
    ap.add_argument("--parties", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--party", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="vllm_decode_profile")
    ap.add_argument("--from", dest="from_dir", default=None)
    ap.add_argument("--tiny", action="store_true", help="a tiny model on CPU: checks the plumbing, measures nothing")
    ap.add_argument("--record", action="store_true", help="with --from: file the profiles in benchmarks/results/runs")
    ap.add_argument("--device-name", default=None, help="--record: the device, for profiles that do not name it")
    ap.add_argument("--command", default="bash benchmarks/h200_vllm.sh profile", help="--record: how they were made")
    a = ap.parse_args(argv)
    if a.record and not a.from_dir:
        ap.error("--record files profiles already made: pass --from DIR (the folder the profile run wrote)")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if a.recipe:  # the child: one engine in this process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # written whole, then renamed: the parent takes a file that exists as a finished profile (`_finish`)
        tmp = Path(a.json + ".part")
        tmp.write_text(json.dumps(job(a), indent=1))
        tmp.replace(a.json)
        return 0
    out = Path(a.from_dir or a.out)
    if not a.from_dir:
        import vllm_gpu

        vllm_gpu.use_shape(a.tiny)
        out.mkdir(parents=True, exist_ok=True)
        model = vllm_gpu.make_model_dir(out / f"{'tiny' if a.tiny else 'llama8b'}_l{a.layers}", a.layers)
        _run_jobs(a, out, model)
    results = [json.loads(p.read_text()) for p in sorted(out.glob("profile_*.json"))]
    order = {r: i for i, r in enumerate(["bf16", "bf16+tattn", "jet_fp8", "jet_fp8+tattn", "jet_fp8+kv8", "jet_fp8+bitwise", "fp8_rollout"])}
    results.sort(key=lambda r: (order.get(r["recipe"], 9), r["mode"]))
    print(summarize(results))
    if a.record:
        print(record(results, a.device_name, a.command))
    return 0


def _run_jobs(a: argparse.Namespace, out: Path, model: Path) -> None:
    """One process per recipe: one after another (each has the GPU to itself), or with --together all alive at once
    and timing in rotation."""
    import vllm_gpu

    if a.together and not a.tiny:
        import torch

        if torch.cuda.is_available():
            vllm_gpu.check_engines_fit(vllm_gpu.SHAPE, a.layers, a.recipes, a.kv_gib,
                                       torch.cuda.get_device_properties(0).total_memory / vllm_gpu.GiB)
    sync_dir = out / f"turns_{int(time.time())}"
    procs: dict[str, tuple[subprocess.Popen, Path]] = {}
    for i, r in enumerate(a.recipes):
        f = out / f"profile_{r}_{a.mode}.json"
        cmd = [sys.executable, __file__, "--recipe", r, "--model", str(model), "--json", str(f), "--mode", a.mode,
               "--layers", str(a.layers), "--prompts", str(a.prompts), "--prompt-len", str(a.prompt_len), "--steps", str(a.steps),
               "--gpu-mem", str(a.gpu_mem), "--kv-gib", str(a.kv_gib), "--gemm-backend", a.gemm_backend, *(["--tiny"] if a.tiny else []),
               *(["--sync-dir", str(sync_dir), "--parties", str(len(a.recipes)), "--party", str(i)] if a.together else [])]
        with open(f.with_suffix(".log"), "w") as log:
            procs[r] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), f)
        if not a.together:
            _finish(r, *procs.pop(r), a.timeout)
    t0 = time.time()
    for r, (proc, f) in procs.items():  # --together: one deadline for all, `--timeout` per recipe
        _finish(r, proc, f, max(1.0, a.timeout * len(a.recipes) - (time.time() - t0)))


def _finish(recipe: str, proc: subprocess.Popen, f: Path, timeout: float, grace_s: float = 30.0) -> None:
    """Wait for one child; a child whose profile is on disk but which has not exited `grace_s` later is killed and
    counted as done (an in-process engine under the CUDA profiler can hang in interpreter teardown)."""
    deadline, written = time.time() + timeout, None
    rc: int | str | None = None
    while rc is None:
        try:
            rc = proc.wait(timeout=1.0)
            continue
        except subprocess.TimeoutExpired:
            pass
        if written is None and f.exists():
            written = time.time()
        if written is not None and time.time() - written > grace_s:
            print(f"[decode_profile] {recipe}: wrote its profile but did not exit within {grace_s:.0f} s; killed", flush=True)
            rc = 0
        elif time.time() > deadline:
            rc = "timeout"
        if rc is not None:
            proc.kill()
            proc.wait()
    print(f"[decode_profile] {recipe}: {'done' if rc == 0 else f'FAILED ({rc}); see ' + str(f.with_suffix('.log'))}", flush=True)


def _host(r: dict) -> dict:
    """What the unprofiled wall record carries beside its value: where the host time went, and the eager linear call."""
    return {"host_self_us": r.get("host_self_us", [])[:15], "host_cum_us": r.get("host_cum_us", [])[:30],
            "eager_linear_call": r.get("eager_linear_call", "")}


def record(results: list[dict], device: str | None, command: str, runs_dir: Path | None = None) -> Path:
    """File the profiles as a benchmark run: per recipe, the decode step's wall and GPU time and each kernel group.
    `device`: None takes the one the jobs recorded (`headline.recorded_device`)."""
    from headline import RUNS, write_run

    device = recorded_device(results, device, "vllm_decode_profile")

    def flat(r: dict) -> dict[str, float]:
        bare = {"decode_step_wall_unprofiled_us": r["decode_step_wall_unprofiled_us"]} if "decode_step_wall_unprofiled_us" in r else {}
        return {"decode_step_wall_us": r["decode_step_wall_us"], **bare, "decode_step_kernel_us": r["decode_step_kernel_us"],
                **{f"decode_step_group_us/{c}": v for c, v in r["categories_us"].items()}}

    bf16 = next((flat(r) for r in results if r["recipe"] == "bf16"), {})
    recs = []
    for r in results:
        shape = (f"Llama-3.1-8B shape, {r['layers']} layers, {r['prompts']} sequences, prompt {r['prompt_len']}, "
                 f"{r['steps']} decode steps, {r['mode']}")
        for key, v in flat(r).items():
            name, _, group = key.partition("/")
            ref = bf16.get(key)
            recs.append({"name": name, "shape": f"{shape}, {group}" if group else shape, "backend": r["recipe"], "value": v,
                         "unit": "us", "ratio_vs_bf16": round(ref / v, 4) if ref and v else None, "command": command,
                         "date": r["date"], "device": device,
                         **({"top_kernels_us": r["top_kernels_us"][:12]} if name == "decode_step_kernel_us" else {}),
                         **(_host(r) if name == "decode_step_wall_unprofiled_us" else {})})
    return write_run(recs, "vllm-decode-profile", results[0]["date"], runs_dir or RUNS)


if __name__ == "__main__":
    raise SystemExit(main())
