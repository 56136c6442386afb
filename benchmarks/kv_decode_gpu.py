"""One decode step's attention for the e4m3 KV cache: the split-KV kernel against vLLM's kernels (a device probe).

`--precision.kv_cache e4m3` halves the KV bytes a decode step reads; whether the step gets faster depends on how
close its attention kernel streams those bytes to the card's bandwidth. For Llama-3.1-8B's attention (32 query heads
on 8 KV heads, head_dim 128, pages of 16) at a batch and context, this times, under a CUDA graph as the engine runs
them:
- `jetrl split-KV` (jetrl_precision.kernels.decode_attention) on the e4m3 cache, with its default launch, each
  (keys per tile, warps, pipeline stages) at its default slicing, and each slicing at its default tile;
- vLLM's Triton kernel (`unified_attention`, what an e4m3-cache engine ran before) on the e4m3 and the BF16 cache;
- FlashAttention-3 (vLLM's build, what a BF16-cache engine runs on Hopper) on the BF16 cache, where it imports;
and reports µs per call (under a CUDA graph; eagerly, back to back, for a kernel that does not capture outside its
engine: each row says which) and the KV bytes read per second. Every kernel's output is checked against the split-KV
kernel's on the same cache (relative error), so a fast wrong kernel is not a result.

    python benchmarks/kv_decode_gpu.py --out $OUT/kv_decode.json [--seqs 64 256 --context 768 1280]
    python benchmarks/kv_decode_gpu.py --record FILE      # here: file a device result under benchmarks/results/runs
    TRITON_INTERPRET=1 python benchmarks/kv_decode_gpu.py --seqs 2 --context 40 --no-sweep --out /tmp/kvd.json   # CPU
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_gemm_triton import graph_us, probe_parser, record_or_check_device, wall_us  # noqa: E402

__all__ = ["HEADS", "KV_HEADS", "DIM", "PAGE", "main"]

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16
# the tile, warps and pipeline depth at the default slicing, then the slicing at the default tile
SWEEP = {"block_n": (64, 128, 256), "num_warps": (4, 8), "num_stages": (2, 3, 4)}
SPLITS_SWEEP = (1, 2, 4, 8)


def _inputs(seqs: int, context: int, device: str):
    from jetrl_precision.formats import E4M3_MAX, FP8_DTYPE

    g = torch.Generator(device=device).manual_seed(0)
    pages = -(-context // PAGE)
    blocks = seqs * pages
    kv16 = (torch.randn(blocks, PAGE, KV_HEADS, 2 * DIM, generator=g, device=device) * 2).to(torch.bfloat16)
    kv8 = kv16.float().clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    q = torch.randn(seqs, HEADS, DIM, generator=g, device=device, dtype=torch.bfloat16)
    table = torch.randperm(blocks, generator=g, device=device).to(torch.int32).view(seqs, pages)
    # contexts spread below `context`, as a batch of rollouts at different lengths has them
    lens = (context - torch.arange(seqs, device=device) % max(1, context // 4)).to(torch.int32)
    cu = torch.arange(seqs + 1, device=device, dtype=torch.int32)
    return q, kv8, kv16, table, lens, cu


def _vllm_triton(q, kv, cu, lens, table, out):
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    one = torch.ones((lens.numel(), KV_HEADS), dtype=torch.float32, device=q.device)
    return lambda: unified_attention(
        q=q, k=kv[..., :DIM], v=kv[..., DIM:], out=out, cu_seqlens_q=cu, max_seqlen_q=1, seqused_k=lens,
        max_seqlen_k=int(lens.max()), softmax_scale=DIM**-0.5, causal=True, window_size=(-1, -1), block_table=table,
        softcap=0, q_descale=None, k_descale=one, v_descale=one)


def _fa3(q, kv, cu, lens, table, out):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    k, v = kv[..., :DIM], kv[..., DIM:]
    return lambda: flash_attn_varlen_func(q, k, v, max_seqlen_q=1, cu_seqlens_q=cu, max_seqlen_k=int(lens.max()),
                                          seqused_k=lens, softmax_scale=DIM**-0.5, causal=True, block_table=table, out=out,
                                          fa_version=3)


def event_us(fn, reps: int = 20) -> float:
    """Median µs per call over 5 runs of `reps` back-to-back eager calls (CUDA events): for kernels whose launch does
    not capture into a CUDA graph outside their engine (vLLM's Triton attention failed to on an H100)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            fn()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1000 / reps)
    return sorted(times)[2]


def _time(fn, device: str) -> tuple[float, str]:
    """(µs per call, how it was timed): under a CUDA graph as the engine replays it, else eager back to back."""
    if device != "cuda":
        return wall_us(fn), "wall"
    try:
        return graph_us(fn), "cuda graph"
    except Exception as e:  # noqa: BLE001 - a capture the kernel does not survive: time it eagerly instead
        print(f"  (no CUDA-graph capture: {type(e).__name__}: {str(e).splitlines()[0][:100]}; timed eagerly)", flush=True)
        torch.cuda.synchronize()
        return event_us(fn), "eager"


def measure(seqs: int, context: int, device: str, sweep: bool) -> list[dict]:
    from jetrl_precision.kernels.decode_attention import BLOCK_N, decode_attention, decode_splits

    q, kv8, kv16, table, lens, cu = _inputs(seqs, context, device)
    keys = int(lens.sum()) * KV_HEADS * DIM * 2  # K and V elements a step must read
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 8
    default = {"splits": decode_splits(seqs, KV_HEADS, sms), "block_n": BLOCK_N, "num_warps": 4}
    ref = decode_attention(q, kv8[..., :DIM], kv8[..., DIM:], cu, lens, table, **default)
    ref16 = decode_attention(q, kv16[..., :DIM], kv16[..., DIM:], cu, lens, table, **default)
    runs = []  # (impl, cache, launch, callable, out, reference)

    def ours(kv, cache, launch, reference):
        out = torch.empty_like(q)
        runs.append(("jetrl split-KV", cache, launch,
                     lambda: decode_attention(q, kv[..., :DIM], kv[..., DIM:], cu, lens, table, out=out, **launch), out, reference))

    ours(kv8, "e4m3", default, ref)
    ours(kv16, "bf16", default, ref16)
    if sweep:
        launches = [{**default, **dict(zip(SWEEP, vals))} for vals in itertools.product(*SWEEP.values())]
        launches += [{**default, "splits": n} for n in SPLITS_SWEEP]
        seen = [default]
        for launch in launches:
            if launch not in seen:
                seen.append(launch)
                ours(kv8, "e4m3", launch, ref)
    for name, make, kv, cache, reference in (("vLLM triton", _vllm_triton, kv8, "e4m3", ref), ("vLLM triton", _vllm_triton, kv16, "bf16", ref16),
                                             ("FlashAttention-3", _fa3, kv16, "bf16", ref16)):
        out = torch.empty_like(q)
        try:
            runs.append((name, cache, {}, make(q, kv, cu, lens, table, out), out, reference))
        except ImportError as e:
            print(f"{name}: not importable here ({e}); skipped", flush=True)
    base = {"command": "python benchmarks/kv_decode_gpu.py", "date": time.strftime("%Y-%m-%d"), "unit": "us", "ratio_vs_bf16": None,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
            "shape": f"Llama-3.1-8B attention ({HEADS} heads / {KV_HEADS} KV heads, head dim {DIM}), {seqs} sequences, "
                     f"context ~{context}, page {PAGE}, decode step"}
    rows = []
    for impl, cache, launch, fn, out, reference in runs:
        try:
            us, how = _time(fn, device)
        except Exception as e:  # noqa: BLE001 - one launch of the sweep that does not compile here is a row, not a stop
            print(f"{impl} {cache} {launch}: failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})", flush=True)
            continue
        err = float((out.float() - reference.float()).norm() / reference.float().norm())
        nbytes = keys * (1 if cache == "e4m3" else 2)
        rows.append({**base, "name": "kv_decode_attention_us", "backend": f"{impl} ({cache} cache)", "value": round(us, 2),
                     "kv_gb_per_s": round(nbytes / us / 1e3, 1), "launch": launch, "rel_err_vs_split_kv": round(err, 6), "timed": how})
    best = {}
    for r in rows:
        key = r["backend"]
        if key not in best or r["value"] < best[key]["value"]:
            best[key] = r
    for r in sorted(best.values(), key=lambda r: r["value"]):
        print(f"{seqs:4d} seqs ctx ~{context:5d}: {r['backend']:34s} {r['value']:9.1f} us  {r['kv_gb_per_s']:7.0f} GB/s  "
              f"err {r['rel_err_vs_split_kv']:.1e}  {r['timed']}  {r['launch'] or ''}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__)
    ap.add_argument("--seqs", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--context", type=int, nargs="+", default=[768, 1280])
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="time only the default launch of the split-KV kernel")
    a = ap.parse_args(argv)
    if record_or_check_device(ap, a, "kv-decode-attention"):
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [r for seqs in a.seqs for ctx in a.context for r in measure(seqs, ctx, device, a.sweep)]
    Path(a.out).write_text(json.dumps(rows, indent=1))
    print(f"{len(rows)} records -> {a.out}")
    bad = [r for r in rows if r["rel_err_vs_split_kv"] > 2e-2]
    for r in bad:
        print(f"WRONG: {r['backend']} {r['launch']} differs from the split-KV kernel by {r['rel_err_vs_split_kv']:.2e}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
