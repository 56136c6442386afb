"""Host cost of the pieces of one eager FP8 engine linear call (`EngineLinear`), against F.linear.

    python benchmarks/host_probe_engine.py

The GPU is held busy by a spin kernel while the calls are enqueued, so each figure is the Python +
launch time alone (what an eager decode step pays per layer), whatever the call's GPU time.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jetrl_precision import quantize_fp8  # noqa: E402
from jetrl_precision.gemm import resolve_backend, torch_backend  # noqa: E402
from jetrl_precision.kernels import quant  # noqa: E402
from jetrl_precision.kernels.layout import row_major_padded_t  # noqa: E402


def host_us(fn, reps: int = 100) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU spin: the calls below only queue behind it
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t0) / reps * 1e6)
        torch.cuda.synchronize()
    return round(statistics.median(times), 1)


def main() -> None:
    import triton

    resolve_backend("torch", "cuda")
    mm = torch_backend.prepared_scaled_mm("cuda")
    k, n, m = 4096, 4096, 64
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    wq = quantize_fp8(w, (128, 128))
    wt, sb = wq.data.t(), row_major_padded_t(wq.scale)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq = quant.quantize_1x128(x, False)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty(k // 128, m, device="cuda")
    kern = quant._quant_1x128_kernel
    pieces = {
        "F.linear": lambda: F.linear(x, w),
        "torch.empty x2": lambda: (torch.empty(m, k, dtype=torch.float8_e4m3fn, device="cuda"), torch.empty(k // 128, m, device="cuda")),
        "x.clone (1 launch)": lambda: x.clone(),
        "triton launch only": lambda: kern[(4, 32)](x, q, s, m, k, x.stride(0), x.stride(1), q.stride(0), q.stride(1),
                                                     s.stride(0), s.stride(1), BLOCK_R=16, POW2=False, num_warps=4),
        "quantize_1x128": lambda: quant.quantize_1x128(x, False),
        "scaled_mm (prepared)": lambda: mm(xq.data, wt, xq.scale, sb, torch.bfloat16),
        "torch._scaled_mm direct": lambda: torch._scaled_mm(xq.data, wt, scale_a=xq.scale, scale_b=sb, out_dtype=torch.bfloat16),
    }
    for name, fn in pieces.items():
        print(name, host_us(fn))
    print("triton", triton.__version__)


if __name__ == "__main__":
    main()
