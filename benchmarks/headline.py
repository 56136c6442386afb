"""Benchmark results: the raw per-run records, and the headline figures the README quotes.

    benchmarks/results/runs/<date>_<NN>_<label>.json   one benchmark run's records (a list), NN in run order
    benchmarks/results/headline.json                  one entry per headline metric, the latest measurement only

    python benchmarks/headline.py            # recompute headline.json from the runs, refresh README.md's table
    python benchmarks/headline.py --check    # exit 1 if either is stale (tests/benchmarks runs the same check)

A record is a dict with at least name, shape, backend, value, unit, ratio_vs_bf16, command, date (and usually
device). Where runs disagree, the newest run holding a figure wins: run files sort by date, then run number.
Headline metrics either come from a record (`METRICS` below says which, and how the value is read from it) or
are written into headline.json by the benchmark that measures them (`set_metric`); recomputing keeps the latter.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RUNS = RESULTS / "runs"
HEADLINE = RESULTS / "headline.json"
README = ROOT / "README.md"
FIELDS = ("value", "unit", "what", "command", "date", "device")

__all__ = ["load_runs", "load_records", "latest", "write_run", "job_device", "recorded_device", "recorded_env", "route_suffix", "Metric",
           "METRICS", "compute_headline", "set_metric", "render_table", "update_readme"]


# ---- raw records ------------------------------------------------------------------------------------
def load_runs(runs_dir: Path = RUNS) -> list[tuple[str, list[dict]]]:
    """[(file name, records)] oldest first."""
    return [(p.name, json.loads(p.read_text())) for p in sorted(Path(runs_dir).glob("*.json"))]


def load_records(runs_dir: Path = RUNS) -> list[dict]:
    """Every record, oldest run first, each tagged with `_run_file`."""
    return [dict(r, _run_file=name) for name, recs in load_runs(runs_dir) for r in recs]


def latest(records: list[dict], name: str, shape: str | None = None, backend: str | None = None,
           where: Callable[[dict], bool] | None = None) -> dict | None:
    """The newest record with this name (and shape, backend, predicate when given), or None."""
    hits = [r for r in records if r.get("name") == name and (shape is None or r.get("shape") == shape)
            and (backend is None or r.get("backend") == backend) and (where is None or where(r))]
    return hits[-1] if hits else None


def route_suffix(verdicts: dict[str, bool] | None) -> str:
    """What a run with JETRL_INVARIANT_VENDOR_GEMM=probe adds to its records' backend: how many of the weight shapes
    it probed went to the vendor GEMM. Empty when the route was off or routed nothing, so the default mode's
    metrics never read a routed run."""
    routed = sum(bool(v) for v in (verdicts or {}).values())
    return f"+cublaslt_route({routed}/{len(verdicts)} shapes)" if routed else ""


# What every run record carries (docs: ../shared/DESIGN.md §6), besides a numeric `value` and a `ratio_vs_bf16`
# that is a number or None.
RECORD_FIELDS = {"name": str, "shape": str, "backend": str, "unit": str, "command": str, "date": str, "device": str}


def record_problems(r: dict) -> list[str]:
    """What a run record lacks or gets wrong (empty when it is complete and typed)."""
    out = [f"{key} missing or not a non-empty {typ.__name__}" for key, typ in RECORD_FIELDS.items()
           if not (isinstance(r.get(key), typ) and r[key])]
    if not isinstance(r.get("value"), (int, float)) or isinstance(r.get("value"), bool):
        out.append("value missing or not a number")
    if "ratio_vs_bf16" not in r or not (r["ratio_vs_bf16"] is None or isinstance(r["ratio_vs_bf16"], (int, float))):
        out.append("ratio_vs_bf16 missing or neither a number nor None")
    if isinstance(r.get("date"), str) and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", r["date"]):
        out.append(f"date {r['date']!r} is not YYYY-MM-DD")
    return out


def write_run(records: list[dict], label: str, date: str, runs_dir: Path = RUNS) -> Path:
    """Write one run's records as `<date>_<NN>_<label>.json`, NN the next run number of that date. An incomplete
    record (`record_problems`) is refused, before anything is written."""
    bad = [(i, p) for i, r in enumerate(records) for p in record_problems(r)]
    if not records or bad:
        raise ValueError(f"write_run({label!r}): " + ("no records" if not records else
                         f"record {bad[0][0]} ({records[bad[0][0]].get('name')!r}): {bad[0][1]} ({len(bad)} problem(s) in all)"))
    runs_dir = Path(runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    n = 1 + max((int(p.name.split("_")[1]) for p in runs_dir.glob(f"{date}_*.json")), default=0)
    slug = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-") or "run"
    path = runs_dir / f"{date}_{n:02d}_{slug}.json"
    path.write_text(json.dumps(records, indent=1) + "\n")
    return path


def job_device() -> str:
    """The device a benchmark job records beside its results: the CUDA device's name, else the CPU."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "x86-64 CPU"


def recorded_device(jobs: list[dict], override: str | None, script: str, flag: str = "--device-name") -> str:
    """The device to file a folder of job results under: the one name the jobs recorded (`job_device`), or
    `override` for results made before jobs recorded it. Lent machines differ (H100 or H200), and a record's ratios
    pair its jobs, so jobs from two devices, or an override that contradicts them, are refused."""
    named = {j.get("device") for j in jobs}
    known = sorted(n for n in named if n)
    if len(known) > 1:
        raise SystemExit(f"{script}: these results come from {len(known)} devices ({', '.join(known)}); record each "
                         "device's results from a folder of their own")
    if override:
        if known and known[0] != override:
            raise SystemExit(f"{script}: the results say they ran on {known[0]}, not {override!r}; drop {flag}")
        return override
    if None in named or not known:
        raise SystemExit(f"{script}: the results do not say which device ran them (made before jobs recorded it); "
                         f"pass {flag} (e.g. {flag} 'NVIDIA H200')")
    return known[0]


def recorded_env(envs: list[dict], override: str | None, script: str, flag: str = "--device_name") -> dict:
    """The env.json a report files its records under: the last folder's, with the device `recorded_device` finds."""
    return {**(envs[-1] if envs else {}), "device": recorded_device(envs, override, script, flag)}


# ---- headline metrics -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Metric:
    """A headline figure read from the records: `pick(records)` -> (value, the record it came from)."""

    key: str
    unit: str
    what: str
    pick: Callable[[list[dict]], tuple[float | None, dict | None]]
    digits: int = 3


def _field(name, shape=None, backend=None, field="value", where=None, transform=lambda v: v):
    def pick(records):
        # A run without the field (a ratio to bf16 from a run that timed no bf16) does not hide an older run with it.
        r = latest(records, name, shape, backend, lambda rec: rec.get(field) is not None and (where is None or where(rec)))
        if r is None or r.get(field) is None:
            return None, None
        return transform(r[field]), r
    return pick


def _auto_variant(name, shape=None, field="ratio_vs_bf16", backend="deep_gemm"):
    """The `auto` jet_fp8 variant of the newest run whose `auto` resolved to `backend`: the first jet_fp8 record a
    run writes (gpu_bench times `auto` first, then the other backends asked for, then the unfused SwiGLU A/B). A run
    on a machine without DeepGEMM resolves `auto` to torch and must not stand in for a row labelled deep_gemm."""
    def first_fp8(run):
        return next((r for r in run if r.get("backend", "").startswith("jet_fp8") and r.get("fused_swiglu") is not False),
                    None)

    def pick(records):
        hits = [r for r in records if r.get("name") == name and (shape is None or r.get("shape") == shape)]
        runs = [[r for r in hits if r["_run_file"] == f] for f in dict.fromkeys(r["_run_file"] for r in hits)]
        runs = [run for run in runs if (first_fp8(run) or {}).get("backend") == f"jet_fp8 {backend}"]
        if not runs:
            return None, None
        run = runs[-1]
        fp8 = first_fp8(run)
        bf16 = [r for r in run if r.get("backend") == "bf16"]
        if field == "peak_ratio":
            return (fp8["peak_mem_gib"] / bf16[0]["peak_mem_gib"], fp8) if bf16 else (None, None)
        return fp8.get(field), fp8
    return pick


def _deepest(name, backend, field, where):
    """The newest record of the deepest model among the matching ones (the layer count in its shape): GRPO speed runs
    are made at whatever depth the lent card holds, and a shallower run does not replace a deeper model's figure."""
    def layers(r):
        m = re.search(r"(\d+) layers", r.get("shape", ""))
        return int(m.group(1)) if m else 0

    def pick(records):
        ok = lambda r: r.get(field) is not None and where(r)  # noqa: E731
        hits = [r for r in records if r.get("name") == name and r.get("backend") == backend and ok(r)]
        if not hits:
            return None, None
        deepest = max(map(layers, hits))
        r = latest(records, name, backend=backend, where=lambda r: ok(r) and layers(r) == deepest)
        return r[field], r
    return pick


def _grpo(field_name, gpus, invert=False):
    return _field(field_name, backend="jet_fp8", field="ratio_vs_bf16", where=lambda r: r.get("gpus") == gpus,
                  transform=(lambda v: 1 / v) if invert else (lambda v: v))


SMOL = "SmolLM2-135M fp32, 16 x 96 tokens, attention=jetrl_invariant"

METRICS: tuple[Metric, ...] = (
    Metric("gemm_fp8_vs_bf16_geomean", "x bf16",
           "FP8 blockwise GEMM TFLOP/s over BF16, geomean of 12 Llama-3.1-8B shapes at M >= 4096, deep_gemm backend "
           "(what auto picks), at the power cap",
           _field("gemm_geomean_ratio_M_ge_4096", backend="deep_gemm")),
    Metric("gemm_fp8_vs_bf16_geomean_cublaslt", "x bf16",
           "the same with the torch backend (cuBLASLt blockwise, no DeepGEMM)",
           _field("gemm_geomean_ratio_M_ge_4096", backend="torch")),
    Metric("linear_fwd_bwd_vs_bf16_cuda_graph", "x bf16",
           "FP8 linear layer forward+backward over nn.Linear BF16, M = 8192, geomean of the 4 Llama-3.1-8B projections, "
           "under CUDA graphs, deep_gemm backend (DeepGEMM built from source)",
           _field("linear_fwd_bwd_geomean_ratio", "M=8192 4 layers graph", backend="deep_gemm")),
    Metric("linear_fwd_bwd_vs_bf16_eager", "x bf16",
           "the same, eager (host-bound for the smaller projections: it depends on the host CPU)",
           _field("linear_fwd_bwd_geomean_ratio", "M=8192 4 layers deep_gemm_cached")),
    Metric("linear_fwd_bwd_vs_bf16_eager_cublaslt", "x bf16",
           "the same, eager, torch backend (cuBLASLt blockwise: what a pip install gives)",
           _field("linear_fwd_bwd_geomean_ratio", "M=8192 4 layers torch_cached")),
    Metric("stack_train_tokens_per_s_ratio", "x bf16",
           "4-layer Llama-3.1-8B-shaped stack, forward+backward+AdamW tokens/s over BF16 (batch 16 x 4096 tokens), "
           "deep_gemm backend",
           _auto_variant("stack_train_tokens_per_s")),
    Metric("stack_peak_memory_ratio", "x bf16", "the same stack's peak GPU memory over BF16's",
           _auto_variant("stack_train_tokens_per_s", field="peak_ratio")),
    Metric("decode_forward_vs_bf16_cuda_graph", "x bf16",
           "the same stack's decode-shaped forward (64 sequences x 1 token) under CUDA graphs, over BF16",
           _auto_variant("decode_forward_us", "M=64 4 layers cuda-graph")),
    Metric("quant_1x128_pct_of_copy", "% of copy", "1x128 activation quantizer bandwidth, 16384x14336, against a device copy",
           _field("quant_1x128", "16384x14336", field="frac_of_copy", transform=lambda v: 100 * v), digits=1),
    Metric("requant_128x1_transposed_pct_of_copy", "% of copy",
           "the WGrad requantizer (saved FP8 1x128 -> 128x1, written transposed), 16384x14336, against a device copy",
           _field("quant_requant_1x128_to_128x1_T", "16384x14336", field="frac_of_copy", transform=lambda v: 100 * v), digits=1),
    Metric("grpo_step_tokens_per_s_ratio_1gpu", "x bf16",
           "GRPO step tokens/s over bf16, 0.68B Llama, 1024-token rollouts on the transformers engine, ZeRO-3, 1 GPU",
           _grpo("grpo_scaling_tokens_per_s", 1)),
    Metric("grpo_step_tokens_per_s_ratio_2gpu", "x bf16", "the same on 2 GPUs", _grpo("grpo_scaling_tokens_per_s", 2)),
    Metric("grpo_weight_sync_time_ratio", "x bf16", "the same run's weight quantization + sync time over bf16's, 1 GPU",
           _grpo("grpo_scaling_weight_sync_s", 1, invert=True)),
    Metric("mismatch_abs_logp_jet_fp8_invariant", "mean |dlogp|",
           "rollout-vs-trainer logprob mismatch per token, jet_fp8, SmolLM2-135M, batch-invariant numerics (CPU fp32)",
           _field("rollout_train_mismatch_abs_logp_diff_mean", SMOL, "jet_fp8"), digits=2),
    Metric("mismatch_abs_logp_bf16_invariant", "mean |dlogp|", "the same, bf16 recipe",
           _field("rollout_train_mismatch_abs_logp_diff_mean", SMOL, "bf16"), digits=2),
    Metric("mismatch_abs_logp_fp8_rollout_invariant", "mean |dlogp|", "the same, fp8_rollout (the off-policy baseline)",
           _field("rollout_train_mismatch_abs_logp_diff_mean", SMOL, "fp8_rollout"), digits=2),
)


# The training-side speed goals (issue: actor update and reference forward at the paper's speed, eager). Read from
# the summary records the linear, stack and reference sections write; torch-backend figures first, since those are
# what a pip install gives (DeepGEMM has to be built: examples/scripts/build_deep_gemm.sh).
METRICS += (
    Metric("linear_fwd_bwd_eager_ratio_torch", "x bf16",
           "FP8 linear forward+backward over nn.Linear BF16, eager, M = 8192, geomean of the 4 Llama-3.1-8B projections, "
           "weights cached, torch backend (cuBLASLt blockwise: what a pip install gives)",
           _field("linear_fwd_bwd_eager_ratio", backend="torch")),
    Metric("linear_fwd_bwd_eager_ratio_deep_gemm", "x bf16", "the same with the deep_gemm backend (DeepGEMM built from source)",
           _field("linear_fwd_bwd_eager_ratio", backend="deep_gemm")),
    Metric("stack_train_step_ratio", "x bf16",
           "4-layer Llama-3.1-8B-shaped stack, forward+backward+AdamW tokens/s over BF16, eager, batch 16 x 4096 tokens, "
           "torch backend; the FP8 layer as convert_to_fp8 makes it (q/k/v and gate/up stacked, SwiGLU and the RMSNorms "
           "fused with their FP8 quantization), the BF16 one transformers' as written",
           _field("stack_train_step_ratio", backend="torch")),
    Metric("reference_forward_ratio", "x bf16",
           "the same stack's no-grad forward (reference / old-logprob pass) over BF16, 16,384 tokens per call, weights "
           "cached, torch backend",
           _field("reference_forward_ratio", backend="torch", where=lambda r: r.get("tokens") == 16384)),
    Metric("reference_forward_ratio_deep_gemm", "x bf16", "the same with the deep_gemm backend (DeepGEMM built from source)",
           _field("reference_forward_ratio", backend="deep_gemm", where=lambda r: r.get("tokens") == 16384)),
)

VLLM_8B = "Llama-3.1-8B shape, {} layers, {} prompts x 256 + 1024 new tokens, {}"
VLLM_SMOL = "SmolLM2-135M-Instruct bf16, 16 chat prompts x <=1024 tokens, T=1, default"
VLLM_SYNC = "Llama-3.1-8B shape, 32 layers, colocated in-process engine"


def _routed(record: dict) -> bool:
    """Whether a record comes from a run with the opt-in cuBLASLt route (`route_suffix`)."""
    return "+cublaslt_route(" in record.get("backend", "")


# What the engine's `auto` ran, newest last: cuBLASLt at every M, then DeepGEMM for decode batches (M <= 512).
ENGINE_AUTO = ("jet_fp8/torch", "jet_fp8/torch+deep_gemm(M<=512)")
# What it runs eagerly: cuBLASLt at every M (DeepGEMM there was measured slower, and is not what it runs).
ENGINE_AUTO_EAGER = ("jet_fp8/torch",)


def _rollout_ratio(layers: int, prompts: int, mode: str, variant: str | None = None):
    """jet_fp8's rollout ratio as the engine's auto runs it, or that of a recipe variant (`jet_fp8+kv8`) whatever
    its backends."""
    picks = ENGINE_AUTO_EAGER if mode == "eager" else ENGINE_AUTO
    where = (lambda r: r.get("backend", "").startswith(f"{variant}/")) if variant else (lambda r: r.get("backend") in picks)
    return _field("vllm_rollout_tokens_per_s", VLLM_8B.format(layers, prompts, mode), field="ratio_vs_bf16", where=where)


METRICS += (
    # The full 32-layer depth is the headline: with 8 layers a decode step's host work is as long as its kernels
    # (docs/vllm.md), which a real 8B model does not see. The 8-layer figures stay for comparison.
    Metric("vllm_rollout_tokens_per_s_ratio", "x bf16",
           "vLLM rollout output tokens/s, jet_fp8 over bf16, default mode (torch.compile + CUDA graphs), "
           "Llama-3.1-8B shape at full depth (32 layers, random weights), 256 prompts x 1024 new tokens, what auto "
           "picks in the engine (DeepGEMM for decode batches up to 512 rows where it imports, cuBLASLt blockwise above)",
           _rollout_ratio(32, 256, "default")),
    Metric("vllm_rollout_tokens_per_s_ratio_64", "x bf16", "the same with 64 prompts", _rollout_ratio(32, 64, "default")),
    Metric("vllm_rollout_tokens_per_s_ratio_kv8", "x bf16",
           "the same (256 prompts), jet_fp8 with the e4m3 KV cache (--precision.kv_cache e4m3: vLLM's FP8 cache at scale "
           "1, attention on the dequantized keys and values, decode steps through the split-KV kernel, mirrored by the "
           "trainer) over bf16 with its BF16 cache",
           _rollout_ratio(32, 256, "default", variant="jet_fp8+kv8")),
    Metric("vllm_rollout_tokens_per_s_ratio_kv8_64", "x bf16", "the same with 64 prompts",
           _rollout_ratio(32, 64, "default", variant="jet_fp8+kv8")),
    Metric("kv_cache_e4m3_logprob_mismatch_x_plain", "x jet_fp8",
           "mean |dlogp| of jet_fp8 with the e4m3 KV cache on vLLM (default mode) against the mirrored trainer's "
           "recompute, over plain jet_fp8's against its trainer on the same model (1.0: the cache adds no mismatch; the "
           "unmirrored trainer's figure is in the record)",
           _field("kv_cache_e4m3_logprob_mismatch", field="x_plain")),
    Metric("vllm_rollout_tokens_per_s_ratio_eager", "x bf16", "the same, 256 prompts, eager mode", _rollout_ratio(32, 256, "eager")),
    Metric("vllm_rollout_tokens_per_s_ratio_eager_64", "x bf16", "the same, 64 prompts, eager mode", _rollout_ratio(32, 64, "eager")),
    Metric("vllm_decode_gemm_gain_64", "x cuBLASLt",
           "the engine's auto (DeepGEMM for decode batches) over cuBLASLt at every M, jet_fp8, 32 layers, 64 prompts, "
           "default mode, one lease, engines taking turns",
           _field("vllm_decode_gemm_gain", VLLM_8B.format(32, 64, "default"))),
    Metric("vllm_decode_gemm_gain_256", "x cuBLASLt", "the same with 256 prompts",
           _field("vllm_decode_gemm_gain", VLLM_8B.format(32, 256, "default"))),
    Metric("vllm_rollout_tokens_per_s_ratio_8layers", "x bf16",
           "the same, default mode, 256 prompts, on the 8-layer truncation of the shape (a quarter of the GPU work per "
           "step, the same host work)",
           _rollout_ratio(8, 256, "default")),
    Metric("vllm_rollout_tokens_per_s_ratio_8layers_64", "x bf16", "the same with 64 prompts", _rollout_ratio(8, 64, "default")),
    Metric("vllm_rollout_tokens_per_s_ratio_8layers_eager", "x bf16", "the same, 256 prompts, eager mode",
           _rollout_ratio(8, 256, "eager")),
    # Eager engines are host-bound, so half depth is where the projections' host time weighs most against the rest
    # of vLLM's step; the engine A/Bs of the native one-call linear (engine_native) ran there (the newest run wins).
    Metric("vllm_rollout_tokens_per_s_ratio_16layers_eager", "x bf16",
           "the same, eager mode, 256 prompts, on the 16-layer truncation of the shape", _rollout_ratio(16, 256, "eager")),
    Metric("vllm_rollout_tokens_per_s_ratio_16layers_eager_64", "x bf16", "the same with 64 prompts",
           _rollout_ratio(16, 64, "eager")),
    Metric("vllm_logprob_mismatch_smollm2_bf16", "mean |dlogp|",
           "vLLM engine vs trainer recompute, per sampled token, SmolLM2-135M-Instruct, 16 chat prompts, T=1, default "
           "mode on the GPU: bf16 recipe", _field("vllm_logprob_mismatch_abs_mean", VLLM_SMOL, "bf16"), digits=2),
    Metric("vllm_logprob_mismatch_smollm2_jet_fp8", "mean |dlogp|", "the same, jet_fp8 (on-policy by construction)",
           _field("vllm_logprob_mismatch_abs_mean", VLLM_SMOL, "jet_fp8"), digits=2),
    Metric("vllm_logprob_mismatch_smollm2_fp8_rollout", "mean |dlogp|", "the same, fp8_rollout against its BF16 trainer (off-policy)",
           _field("vllm_logprob_mismatch_abs_mean", VLLM_SMOL, "fp8_rollout"), digits=2),
    Metric("vllm_first_start_seconds_jet_fp8", "s",
           "first start of a jet_fp8 vLLM engine on a fresh machine, default mode, empty compile caches (torch.compile, "
           "and DeepGEMM's decode kernels compiled while vLLM captures its CUDA graphs), 32-layer 8B shape, a bf16 engine "
           "starting beside it",
           _field("vllm_first_start_seconds", "Llama-3.1-8B shape, 32 layers, default, cold cache, 2 engines starting together",
                  where=lambda r: r.get("backend") in ENGINE_AUTO), digits=3),
    Metric("vllm_warm_start_seconds_jet_fp8", "s", "the same engine started again on that machine (both compile caches warm)",
           _field("vllm_first_start_seconds", where=lambda r: r.get("backend") in ENGINE_AUTO and "32 layers" in r["shape"]
                  and "warm compile caches" in r["shape"]), digits=3),
    Metric("vllm_weight_sync_seconds_8b", "s",
           "FP8 weight sync into a colocated in-process vLLM engine, 32-layer Llama-3.1-8B shape (9.1 GB: e4m3 bytes + "
           "scales, bf16 embeddings and norms; bf16 moves 16.1 GB)", _field("vllm_weight_sync_seconds", VLLM_SYNC, "jet_fp8"), digits=2),
)


METRICS += (
    Metric("e2e_grpo_step_ratio_1gpu", "x bf16",
           "GRPO speed-up on 1 GPU (bf16 step time over jet_fp8 step time): Llama-3.1-8B-shaped model (the deepest measured; layer count in the record), 1024-token "
           "rollouts, n=4, vLLM engine colocated (default mode, asleep in training), ZeRO-2, FP8 sync + digest check every step; "
           "both sides' GEMM backend is the record's gemm_backend (auto: DeepGEMM in training and for the engine's decode batches)",
           _deepest("e2e_grpo_step_s", "jet_fp8", "ratio_vs_bf16", lambda r: r.get("gpus") == 1 and "Liger" not in r["shape"])),
    Metric("e2e_grpo_step_ratio_1gpu_fp8_rollout", "x bf16",
           "the same for fp8_rollout + TIS (FP8 engine, BF16 training; the deepest model it ran at)",
           _deepest("e2e_grpo_step_s", "fp8_rollout", "ratio_vs_bf16", lambda r: r.get("gpus") == 1 and "Liger" not in r["shape"])),
    Metric("e2e_grpo_step_ratio_1gpu_liger", "x bf16",
           "the same with --ds.use_liger_kernel on both sides (Liger's RMSNorm and rotary kernels; its SwiGLU for bf16, the FP8 "
           "flow's fused SwiGLU for jet_fp8)",
           _field("e2e_grpo_step_s", backend="jet_fp8", field="ratio_vs_bf16",
                  where=lambda r: r.get("gpus") == 1 and "Liger" in r["shape"])),
    Metric("grpo_reward_gap_jet_fp8_vs_bf16_pct", "pct points",
           "GRPO on SmolLM2-135M-Instruct, generated arithmetic word problems, math-verify reward: jet_fp8's mean reward over "
           "the last quarter of the steps minus bf16's, in percentage points (the same run's fp8_rollout + TIS is in the record)",
           _field("grpo_reward_gap_vs_bf16_pp", backend="jet_fp8"), digits=2),
)


METRICS += (
    Metric("ray_2gpu_step_ratio", "x bf16",
           "GRPO speed-up in Ray mode on 2 GPUs (bf16 step time over jet_fp8 step time): policy (+ reference) on GPU 0, a separate vLLM engine on "
           "GPU 1, FP8 bytes + scales broadcast over NCCL and the digest check after every step; Llama-3.1-8B-shaped model "
           "(layer count, rollout size and vLLM mode in the record)",
           _field("ray_grpo_step_s", backend="jet_fp8", field="ratio_vs_bf16", where=lambda r: r.get("variant") == "ray2")),
    Metric("ray_nccl_sync_seconds_8b", "s",
           "jet_fp8 weight sync from a trainer on one GPU into a vLLM engine actor on another over NCCL (quantize, broadcast, "
           "install), 32-layer Llama-3.1-8B shape, mean of the syncs after the first; bytes and bf16's time in the record",
           _field("ray_sync_seconds", backend="jet_fp8", where=lambda r: r.get("layers") == 32 and r.get("sync_backend") == "nccl"),
           digits=2),
    Metric("ray_1to2gpu_step_speedup_jet_fp8", "x 1 GPU",
           "jet_fp8 GRPO step time on 1 GPU (engine colocated in the trainer's process) over Ray on 2 GPUs (separate engine), "
           "same model and rollout plan",
           _field("ray_scaling_step_speedup", backend="jet_fp8", where=lambda r: r.get("variant") == "ray2")),
)


FIDELITY = ("GRPO on SmolLM2-135M-Instruct from one start, generated arithmetic word problems, math-verify reward, "
            "vLLM engine: final held-out pass@1 of {} minus bf16's, in percentage points (spread in the record)")
METRICS += (
    Metric("grpo_eval_gap_jet_fp8_vs_bf16_pct", "pct points", FIDELITY.format("jet_fp8 (the unified flow)"),
           _field("grpo_eval_gap_vs_bf16_pp", backend="jet_fp8"), digits=2),
    Metric("grpo_eval_gap_fp8_rollout_vs_bf16_pct", "pct points", FIDELITY.format("fp8_rollout (BF16 training, FP8 rollout, no TIS)"),
           _field("grpo_eval_gap_vs_bf16_pp", backend="fp8_rollout"), digits=2),
)


STRICT = "the same with JETRL_INVARIANT_VENDOR_GEMM=off (every GEMM on the invariant kernels: the strict mode)"


def _bitwise(key: str, unit: str, what: str, name: str, where: Callable[[dict], bool], field: str = "value",
             digits: int = 3, strict_where: Callable[[dict], bool] | None = None,
             strict_what: str = STRICT) -> tuple[Metric, Metric]:
    """A bitwise-mode figure twice: the default mode (the cuBLASLt route on, records labelled by `route_suffix`), and
    `<key>_invariant_kernels` right below it (JETRL_INVARIANT_VENDOR_GEMM=off: every GEMM on the invariant kernels;
    `strict_where` where its records have another shape)."""
    strict = strict_where or where
    return (Metric(key, unit, what, _field(name, field=field, where=lambda r: _routed(r) and where(r)), digits),
            Metric(f"{key}_invariant_kernels", unit, strict_what,
                   _field(name, field=field, where=lambda r: not _routed(r) and strict(r)), digits))


def _bitwise_engine(prompts: int) -> Callable[[dict], bool]:
    shape = VLLM_8B.format(32, prompts, "default")
    return lambda r: r.get("shape") == shape and r.get("backend", "").startswith("jet_fp8+bitwise/triton_invariant")


# The bitwise mode's default hands the weight shapes whose cuBLASLt GEMM gave the invariant kernel's bits at every
# probed M to cuBLASLt, in the engine and the trainer (jetrl_precision.gemm.vendor_route); each figure also has its
# strict-mode row right below it, so every default row says in full what it measures.
METRICS += (
    *_bitwise("bitwise_logprob_mismatch_smollm2", "max |dlogp|",
              "--precision.bitwise on vLLM (default mode: torch.compile + CUDA graphs) against the trainer's recompute, "
              "SmolLM2-135M-Instruct, bf16 and jet_fp8, every sampled token, padded and packed: the largest |dlogp| "
              "(0.0: every log-prob has the trainer's bits; prompt count and length in the record)",
              "bitwise_logprob_mismatch", lambda r: "SmolLM2" in r.get("shape", "")),
    *_bitwise("bitwise_logprob_mismatch_8b", "max |dlogp|",
              "--precision.bitwise on vLLM (default mode) against the trainer's recompute on a Llama-3.1-8B-shaped model "
              "(8 layers, random weights), bf16 and jet_fp8: the largest |dlogp| (prompt count and length in the record)",
              "bitwise_logprob_mismatch", lambda r: "Llama-3.1-8B" in r.get("shape", "")),
    *_bitwise("bitwise_rollout_cost_ratio", "x jet_fp8",
              "vLLM rollout tokens/s of jet_fp8 with --precision.bitwise over plain jet_fp8, default mode, Llama-3.1-8B "
              "shape at full depth (32 layers), 256 prompts x 1024 new tokens",
              "bitwise_rollout_cost_ratio", lambda r: r.get("shape") == VLLM_8B.format(32, 256, "default"),
              strict_where=lambda r: r.get("shape") == VLLM_8B.format(8, 256, "default"),
              strict_what=STRICT[:-1] + ", on the 8-layer truncation of the shape)"),
    *_bitwise("bitwise_rollout_tokens_per_s_ratio", "x bf16",
              "vLLM rollout tokens/s of jet_fp8 with --precision.bitwise over bf16, default mode, Llama-3.1-8B shape at "
              "full depth (32 layers), 256 prompts x 1024 new tokens", "vllm_rollout_tokens_per_s", _bitwise_engine(256),
              field="ratio_vs_bf16"),
    *_bitwise("bitwise_rollout_tokens_per_s_ratio_64", "x bf16",
              "vLLM rollout tokens/s of jet_fp8 with --precision.bitwise over bf16, default mode, Llama-3.1-8B shape at "
              "full depth (32 layers), 64 prompts x 1024 new tokens", "vllm_rollout_tokens_per_s",
              _bitwise_engine(64), field="ratio_vs_bf16"),
    *_bitwise("bitwise_e2e_step_ratio", "x jet_fp8",
              "GRPO step time of jet_fp8 over jet_fp8 with --precision.bitwise (engine log-probs proven equal and used: "
              "no old-logprob recompute), Llama-3.1-8B shape, 8 layers, 64 prompts x 4 samples x 1024 tokens, ZeRO-2, "
              "colocated vLLM; above 1.0 the bitwise step is faster",
              "bitwise_e2e_step_ratio", lambda r: r.get("backend", "").startswith("jet_fp8+bitwise")),
    *_bitwise("bitwise_e2e_mismatch", "mean |dlogp|",
              "the bitwise GRPO run's engine-vs-trainer mismatch on the sampled tokens it checks (0.0: exactly on-policy)",
              "e2e_grpo_mismatch_abs_logp_mean", lambda r: r.get("backend", "").startswith("jet_fp8+bitwise")),
)
# Keys of earlier layouts, dropped from headline.json when it is rewritten.
RETIRED = ("bitwise_logprob_mismatch_8b_cublaslt_route", "bitwise_rollout_cost_ratio_cublaslt_route",
           "bitwise_e2e_step_ratio_cublaslt_route")


def _round(v: float, digits: int) -> float:
    if v == 0 or not math.isfinite(v):
        return v
    if abs(v) >= 1:
        return round(v, digits)
    return float(f"{v:.{digits}g}")


def compute_headline(records: list[dict], current: dict | None = None) -> dict:
    """headline.json's content: `current`'s entries, with every metric that has a record replaced by its newest value."""
    metrics = {k: v for k, v in (current or {}).get("metrics", {}).items() if k not in RETIRED}
    for m in METRICS:
        value, r = m.pick(records)
        if value is None:
            continue
        metrics[m.key] = {
            "value": _round(value, m.digits), "unit": m.unit, "what": m.what, "command": r["command"],
            "date": r["date"], "device": r.get("device", ""), "record": {
                "run_file": r["_run_file"], "name": r["name"], "shape": r["shape"], "backend": r["backend"]},
        }
    # METRICS order first ("the same ..." rows read against the row above), then figures benchmarks set themselves.
    order = [m.key for m in METRICS if m.key in metrics] + [k for k in metrics if k not in {m.key for m in METRICS}]
    return {"metrics": {k: metrics[k] for k in order}}


def set_metric(key: str, value: float, unit: str, what: str, command: str, date: str, device: str, path: Path = HEADLINE) -> None:
    """Record a headline figure that is not read from the run records (a benchmark writes its own)."""
    data = json.loads(Path(path).read_text()) if Path(path).exists() else {"metrics": {}}
    data["metrics"][key] = {"value": value, "unit": unit, "what": what, "command": command, "date": date, "device": device}
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


# ---- the README table -----------------------------------------------------------------------------
def _fmt(entry: dict) -> str:
    v, unit = entry["value"], entry["unit"]
    if unit.startswith("x "):
        return f"{v:.2f}x"
    if unit.startswith("%"):
        return f"{v:.0f}%"
    return f"{v:.2g}" if abs(v) < 1e-2 else f"{v:.3g}"


def _md(row: str) -> str:
    """One markdown table row from cells joined by NUL (pipes inside cells escaped)."""
    return "| " + " | ".join(c.replace("|", "\\|") for c in row.split("\0")) + " |"


def render_table(headline: dict) -> str:
    rows = ["| figure | value | measured on |", "|---|---|---|"]
    for e in headline["metrics"].values():
        unit = "" if e["unit"].startswith(("x ", "%")) else f" {e['unit']}"
        rows.append(_md(f"{e['what']}\0**{_fmt(e)}**{unit}\0{e['device']}, {e['date']}"))
    return "\n".join(rows) + "\n"


BLOCK = re.compile(r"(<!-- BEGIN GENERATED: headline -->\n).*?(<!-- END GENERATED: headline -->)", re.S)


def readme_block(text: str) -> str | None:
    m = BLOCK.search(text)
    return None if m is None else text[m.end(1):m.start(2)]


def update_readme(headline: dict, path: Path = README) -> bool:
    text = Path(path).read_text()
    if readme_block(text) is None:
        raise ValueError(f"{path} has no '<!-- BEGIN GENERATED: headline -->' block")
    new = BLOCK.sub(lambda m: m.group(1) + render_table(headline) + m.group(2), text)
    if new != text:
        Path(path).write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only check that headline.json and README.md are current")
    a = ap.parse_args(argv)
    current = json.loads(HEADLINE.read_text()) if HEADLINE.exists() else None
    fresh = compute_headline(load_records(), current)
    if a.check:
        stale = []
        if fresh != current:
            stale.append(f"{HEADLINE.relative_to(ROOT)} differs from the run records")
        if readme_block(README.read_text()) != render_table(fresh):
            stale.append("README.md's headline table differs from headline.json")
        for s in stale:
            print(f"stale: {s}; run python benchmarks/headline.py", file=sys.stderr)
        return 1 if stale else 0
    HEADLINE.write_text(json.dumps(fresh, indent=1) + "\n")
    changed = update_readme(fresh)
    print(f"wrote {HEADLINE.relative_to(ROOT)} ({len(fresh['metrics'])} metrics); README.md {'updated' if changed else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
