"""Which FP8 GEMM backends compute the batch-invariant kernel's bits, and at which M (a device probe).

The bitwise mode (--precision.bitwise) runs every forward GEMM on `triton_invariant`, in the engine at decode sizes
and in the trainer at thousands of tokens, where that kernel is about half cuBLASLt's speed. Were another backend
to give the same bits for training-sized M, the trainer could use it there and keep the guarantee. This probe
answers that, per projection of Llama-3.1-8B and SmolLM2-135M, per M, for every backend that runs on the device:

- `vs_invariant`: elements whose bits differ from the invariant kernel's at the largest M (same rows), for the
  tables' numerics and for one split along K (`split1`; the same as the tables' where they already use one);
- `self`: elements whose bits differ between the backend at this M and its own rows at the largest M (its own
  batch invariance);
- `rel_err`: its relative error against the float64 product of the dequantized operands, on the first 512 rows
  (a sanity bound);
- `us`: the GEMM alone under a CUDA graph (operands quantized beforehand), to weigh what a switch would save.

The BF16 lm_head is compared likewise: `bf16_gemm_nt_invariant` against `F.linear` (cuBLAS).
A backend that is bit-equal to the invariant kernel at every M >= some M0 and every shape is a candidate for the
trainer's large-M GEMMs in the bitwise mode; this script only measures, it changes nothing.

    python benchmarks/gemm_equivalence_gpu.py --out $OUT/gemm_equivalence.json [--m 1 64 256 1024 4096 16384]
    TRITON_INTERPRET=1 python benchmarks/gemm_equivalence_gpu.py --models tiny --m 1 16 --out /tmp/ge.json  # CPU

On a CPU (the interpreter) only the invariant kernels and the `emulated` reference run, and the interpreter's
fp32 -> bf16 cast truncates where the GPU rounds: the counts mean nothing there; it proves the script.
Exit status 0 whatever it finds; `--record FILE` files a measured FILE under benchmarks/results/runs/.
"""

from __future__ import annotations

import datetime
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_gemm_triton import MODELS, graph_us, probe_parser, record_or_check_device  # noqa: E402

__all__ = ["main"]

_FP8_BACKENDS = ("triton_invariant", "torch", "deep_gemm", "triton", "emulated")
_ERR_ROWS = 512  # rows the float64 error bound reads: an 8B lm_head at 16k rows would take 17 GB in float64


def _exact(q) -> torch.Tensor:
    """A QuantizedTensor's values in float64, each e4m3 byte times its fp32 scale exactly (no float32 step)."""
    rows, cols = q.shape
    b0, b1 = q.block
    scale = q.scale.double().repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
    return q.data.double() * scale


def _timed(fn) -> dict:
    """{"us": the call's time under a CUDA graph}, or why it could not be captured (a finding, not a crash)."""
    try:
        return {"us": round(graph_us(fn), 2)}
    except Exception as e:  # noqa: BLE001 - e.g. a backend that synchronizes with the host inside the call
        torch.cuda.synchronize()
        return {"us_error": f"{type(e).__name__}: {str(e)[:120]}"}


def main(argv=None) -> int:
    ap = probe_parser(__doc__)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 64, 256, 1024, 4096, 16384])
    ap.add_argument("--models", nargs="+", default=["8b", "smollm2"], choices=list(MODELS))
    a = ap.parse_args(argv)
    if record_or_check_device(ap, a, "gemm-equivalence"):
        return 0
    cuda = torch.cuda.is_available()
    import torch.nn.functional as F

    from jetrl_precision import quantize_fp8
    from jetrl_precision.gemm import available_backends, gemm_nt
    from jetrl_precision.gemm.vendor_route import bit_differences, outlier_operands
    from jetrl_precision.kernels import invariant_gemm as ig

    dev = "cuda" if cuda else "cpu"
    usable = available_backends(dev)
    backends = [b for b in _FP8_BACKENDS if usable.get(b) is None and (cuda or b in ("triton_invariant", "emulated"))]
    skipped = {b: usable.get(b, "not registered") for b in _FP8_BACKENDS if b not in backends}
    print(f"backends: {', '.join(backends)}" + "".join(f"\n  {b} skipped: {why}" for b, why in skipped.items()), flush=True)
    ms = sorted(set(a.m))
    base = {"command": "python " + " ".join(["benchmarks/gemm_equivalence_gpu.py", *(argv or sys.argv[1:])]),
            "date": datetime.date.today().isoformat(),
            "device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)",
            "name": "gemm_bits_vs_invariant", "unit": "elements", "ratio_vs_bf16": None}
    records: list[dict] = []
    seeds = itertools.count()  # one operand seed per shape, the same in every run

    def report(label: str, backend: str, m: int, **found) -> None:
        # Records need a number: a refused call is recorded as one refusal, under its own name.
        kind = {"name": "gemm_call_refused", "unit": "calls", "value": 1} if "error" in found else {"value": found["vs_invariant"]}
        records.append(dict(base, shape=f"{label} M={m}", backend=backend, m=m, **kind, **found))
        cells = "  ".join(f"{k} {v}" for k, v in found.items())
        print(f"  {backend:<18} M={m:<6} {cells}", flush=True)

    for model in a.models:
        name, projs, (vocab, hidden) = MODELS[model]
        for proj, (n, k) in projs.items():
            label = f"{proj} {name}"
            print(f"{label}: N={n} K={k}", flush=True)
            w, x = outlier_operands(n, k, max(ms), dev, next(seeds))
            wq = quantize_fp8(w, (128, 128))
            xq = {m: quantize_fp8(x[:m], (1, 128)) for m in ms}  # 1x128 groups are row-local: the same bytes per row
            ref64 = _exact(xq[max(ms)])[:_ERR_ROWS] @ _exact(wq).T  # enough rows for an error bound
            table = ig.invariant_numerics(k, torch.float8_e4m3fn)
            variants = {"table": table}
            if table.split_k != 1:
                variants["split1"] = ig.InvariantNumerics(block_k=table.block_k, split_k=1)

            def invariant(m: int, numerics) -> torch.Tensor:
                cfg = ig.InvariantConfig.of(numerics, ig.invariant_tile(n, k, torch.float8_e4m3fn, m))
                q = xq[m]
                return ig.fp8_gemm_nt_invariant(q.data, q.scale, wq.data, wq.scale, 128, torch.bfloat16, cfg)

            refs = {v: invariant(max(ms), nu) for v, nu in variants.items()}
            for backend in backends:
                own_big = None
                for m in sorted(ms, reverse=True):
                    try:
                        out = gemm_nt(xq[m], wq, torch.bfloat16, backend)
                    except Exception as e:  # noqa: BLE001 - a backend that refuses a shape is a finding, not a crash
                        report(label, backend, m, error=f"{type(e).__name__}: {str(e)[:160]}")
                        continue
                    own_big = out if own_big is None else own_big
                    found = {f"vs_invariant{'' if v == 'table' else '_' + v}": bit_differences(out, r[:m])
                             for v, r in refs.items()}
                    found["self"] = bit_differences(out, own_big[:m])
                    r64 = ref64[:m]
                    found["rel_err"] = float(f"{float((out[:_ERR_ROWS].double() - r64).norm() / r64.norm()):.3e}")
                    if cuda and backend != "emulated":  # the GEMM alone, operands quantized beforehand
                        found.update(_timed(lambda m=m, backend=backend: gemm_nt(xq[m], wq, torch.bfloat16, backend)))
                    report(label, backend, m, elements=m * n, **found)
            if cuda:
                torch.cuda.empty_cache()
        # The lm_head stays BF16 in every recipe: the invariant kernel against cuBLAS.
        label = f"lm_head {name}"
        print(f"{label}: N={vocab} K={hidden}", flush=True)
        w, x = outlier_operands(vocab, hidden, max(ms), dev, next(seeds))
        ref = ig.bf16_gemm_nt_invariant(x, w)
        ref64 = x[:_ERR_ROWS].double() @ w.double().T
        for backend, fn in (("bf16_invariant", lambda m: ig.bf16_gemm_nt_invariant(x[:m], w)),
                            ("F.linear", lambda m: F.linear(x[:m], w))):
            own_big = fn(max(ms))
            for m in sorted(ms, reverse=True):
                out = fn(m)
                r64 = ref64[:m]
                timed = _timed(lambda m=m, fn=fn: fn(m)) if cuda else {}
                report(label, backend, m, elements=m * vocab, vs_invariant=bit_differences(out, ref[:m]),
                       self=bit_differences(out, own_big[:m]),
                       rel_err=float(f"{float((out[:_ERR_ROWS].double() - r64).norm() / r64.norm()):.3e}"), **timed)
    Path(a.out).write_text(json.dumps(records, indent=1))
    print(f"{len(records)} records -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
