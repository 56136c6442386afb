"""What padding WGrad's operands in the quantizers saves: FP8 linear fwd+bwd of the four Llama-3.1-8B projections at a
token count that is not a multiple of 128 (4 sequences of 1032 tokens, as a GRPO micro-batch trimmed to its longest
prompt), with the operands padded by the quantizer kernels (the default on the torch and DeepGEMM backends) against
the GEMM's own padding copy of both operands, interleaved in one process. CUDA events, median of the rounds.

    python benchmarks/wgrad_padding_gpu.py [--tokens 4128] [--iters 20] [--rounds 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROJECTIONS = {"qkv": (4096, 6144), "o_proj": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def main(argv: list[str] | None = None) -> int:
    import torch

    from jetrl_precision import Fp8Linear, get_recipe
    from jetrl_precision.gemm import torch_backend

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    recipe = get_recipe("jet_fp8")
    out = {"tokens": a.tokens, "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "ms": {}}
    for name, (k, n) in PROJECTIONS.items():
        lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(a.tokens, k, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
        dy = torch.randn(a.tokens, n, device="cuda", dtype=torch.bfloat16) * 1e-2
        times: dict[int, list[float]] = {128: [], 1: []}
        layers = {}
        for mult in (128, 1):  # a layer's plan reads the multiple when it is built
            torch_backend.TorchPreparedGemm.wgrad_k_multiple = mult
            layers[mult] = Fp8Linear.from_linear(lin, recipe.train_fprop, recipe.train_backward, "torch")
            for _ in range(3):
                layers[mult](x).backward(dy)
        torch_backend.TorchPreparedGemm.wgrad_k_multiple = 128
        for _ in range(a.rounds):
            for mult in (128, 1):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                for _ in range(a.iters):
                    layers[mult](x).backward(dy)
                end.record()
                torch.cuda.synchronize()
                times[mult].append(start.elapsed_time(end) / a.iters)
        med = {m: statistics.median(v) for m, v in times.items()}
        out["ms"][name] = {"padded_by_quantizers": round(med[128], 3), "padded_by_gemm": round(med[1], 3),
                           "ratio": round(med[1] / med[128], 4)}
        print(f"{name:8s} M={a.tokens}: quantizers pad {med[128]:.3f} ms, GEMM pads {med[1]:.3f} ms -> {med[1] / med[128]:.3f}x",
              flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
