"""The bitwise mode's attention at decode: one step of the batch-invariant paged attention, a GQA group per tile
against one head per tile (a device probe).

The bitwise vLLM engine attends with `kernels.invariant_attention.paged_attention`. A decode step reads every
sequence's whole KV cache; with one query head per tile a group of GQA heads reads it once per head, with the group
packed into one tile (the default) once per KV head. This times one decode step of `--seqs` sequences at a given
context, per model shape, both ways, under a CUDA graph (as the engine runs it), checks that both give the same
bits, and reports the KV bytes each step must read against the time (GB/s).

    python benchmarks/attention_decode_gpu.py --out $OUT/attention_decode.json [--seqs 64 256 --context 768]
    python benchmarks/attention_decode_gpu.py --record FILE     # here: file a device result under benchmarks/results/runs
    TRITON_INTERPRET=1 python benchmarks/attention_decode_gpu.py --shapes smollm2 --seqs 2 --context 40 --out /tmp/ad.json  # CPU
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_gemm_triton import graph_us, probe_parser, record_or_check_device, wall_us  # noqa: E402

__all__ = ["SHAPES", "main"]

SHAPES = {"llama8b": (32, 8, 128), "smollm2": (9, 3, 64)}  # query heads, KV heads, head dim
PAGE = 16


def measure(shape: str, seqs: int, context: int, device: str) -> list[dict]:
    from jetrl_precision.kernels import invariant_attention as ia

    heads, kv_heads, dim = SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(0)
    pages = -(-context // PAGE)
    blocks = seqs * pages
    kc = torch.randn(blocks, PAGE, kv_heads, dim, generator=g, device=device, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(seqs, heads, dim, generator=g, device=device, dtype=torch.bfloat16) * 4
    table = torch.randperm(blocks, generator=g, device=device).to(torch.int32).view(seqs, pages)
    # contexts spread below `context` so the step sees mixed lengths, as a batch of rollouts does
    lens = (context - torch.arange(seqs, device=device) % max(1, context // 4)).to(torch.int32)
    cu = torch.arange(seqs + 1, device=device, dtype=torch.int32)
    outs = {p: torch.empty_like(q) for p in (True, False)}
    calls = {p: (lambda p=p: ia.paged_attention(q, kc, vc, cu, lens, table, 1, out=outs[p], pack_heads=p)) for p in (True, False)}
    timer = graph_us if device == "cuda" else wall_us
    us = {p: timer(calls[p]) for p in (True, False)}
    same = bool(torch.equal(outs[True].view(torch.int16), outs[False].view(torch.int16)))
    kv_bytes = int(lens.sum()) * kv_heads * dim * 2 * 2  # K and V, bf16: what a step must read at least
    base = {"command": "python benchmarks/attention_decode_gpu.py", "date": time.strftime("%Y-%m-%d"),
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)", "unit": "us", "ratio_vs_bf16": None,
            "shape": f"{shape} ({heads} heads / {kv_heads} KV heads, head dim {dim}), {seqs} sequences, context ~{context}, page {PAGE}"}
    rows = []
    for p in (False, True):
        rows.append({**base, "name": "bitwise_decode_attention_us", "backend": "group_per_tile" if p else "head_per_tile",
                     "value": round(us[p], 2), "kv_gb_per_s": round(kv_bytes / us[p] / 1e3, 1),
                     "heads_per_tile": ia.heads_per_tile(heads // kv_heads) if p else 1, "same_bits": same})
    print(f"{shape:8s} {seqs} seqs ctx ~{context}: head per tile {us[False]:8.1f} us, group per tile {us[True]:8.1f} us "
          f"({us[False] / us[True]:.2f}x), {kv_bytes / us[True] / 1e3:.0f} GB/s of KV, same bits {same}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__)
    ap.add_argument("--seqs", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--context", type=int, default=768)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    a = ap.parse_args(argv)
    if record_or_check_device(ap, a, "attention-decode"):
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [r for shape in a.shapes for seqs in a.seqs for r in measure(shape, seqs, a.context, device)]
    Path(a.out).write_text(json.dumps(rows, indent=1))
    print(f"{len(rows)} records -> {a.out}")
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
