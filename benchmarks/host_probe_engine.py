"""Host cost of the pieces of one eager FP8 engine linear call (GPU held busy, so launches only queue)."""
import statistics, sys, time
from pathlib import Path
import torch, torch.nn.functional as F
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jetrl_precision import quantize_fp8
from jetrl_precision.kernels import quant
from jetrl_precision.gemm import torch_backend, resolve_backend
from jetrl_precision.kernels.layout import row_major_padded_t

def host_us(fn, reps=100):
    for _ in range(10): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(7):
        torch.cuda._sleep(100_000_000); t0 = time.perf_counter()
        for _ in range(reps): fn()
        ts.append((time.perf_counter() - t0) / reps * 1e6); torch.cuda.synchronize()
    return round(statistics.median(ts), 1)

resolve_backend("torch", "cuda"); mm = torch_backend.prepared_scaled_mm("cuda")
k, n, m = 4096, 4096, 64
w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16); wq = quantize_fp8(w, (128, 128)); wt = wq.data.t(); sb = row_major_padded_t(wq.scale)
x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16); xq = quant.quantize_1x128(x, False)
q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device="cuda"); s = torch.empty(k // 128, m, device="cuda")
kern = quant._quant_1x128_kernel
print("F.linear", host_us(lambda: F.linear(x, w)))
print("torch.empty x2", host_us(lambda: (torch.empty(m, k, dtype=torch.float8_e4m3fn, device="cuda"), torch.empty(k // 128, m, device="cuda"))))
print("x.clone (1 launch)", host_us(lambda: x.clone()))
print("triton launch only", host_us(lambda: kern[(4, 32)](x, q, s, m, k, x.stride(0), x.stride(1), q.stride(0), q.stride(1), s.stride(0), s.stride(1), BLOCK_R=16, POW2=False, num_warps=4)))
print("quantize_1x128", host_us(lambda: quant.quantize_1x128(x, False)))
print("scaled_mm", host_us(lambda: mm(xq.data, wt, xq.scale, sb, torch.bfloat16)))
print("torch._scaled_mm direct", host_us(lambda: torch._scaled_mm(xq.data, wt, scale_a=xq.scale, scale_b=sb, out_dtype=torch.bfloat16)))
import triton; print("triton", triton.__version__)
