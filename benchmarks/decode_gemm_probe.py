"""Decode-size FP8 GEMM options on the GPU, each timed under a CUDA graph (one engine step's GEMM, no host cost).

    python benchmarks/decode_gemm_probe.py

Compares, for the Llama-3.1-8B projections at M = 64 and 256: bf16 F.linear; our 1x128 quantizer + cuBLASLt
blockwise scaled_mm (what the jetrl_fp8 engine runs); vLLM's CUTLASS blockwise kernel and its Triton
block GEMM (when vLLM is importable); and whether vLLM's per-token-group quantizer gives our bytes.
"""
import json, sys, time
from pathlib import Path
import torch, torch.nn.functional as F
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jetrl_precision import quantize_fp8
from jetrl_precision.kernels import quant
from jetrl_precision.gemm import torch_backend, resolve_backend
from jetrl_precision.kernels.layout import row_major_padded_t

def graph_us(fn, reps=50):
    fn(); torch.cuda.synchronize()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps): fn()
    g.replay(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(5):
        e0.record(); g.replay(); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1) * 1000 / reps)
    return sorted(ts)[2]

resolve_backend("torch", "cuda")
mm = torch_backend.prepared_scaled_mm("cuda")
rows = []
try:
    from vllm import _custom_ops as vops
except Exception as e:
    vops = None; print("no vllm ops:", e)
try:
    from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8, w8a8_block_fp8_matmul
except Exception as e:
    per_token_group_quant_fp8 = w8a8_block_fp8_matmul = None; print("no vllm fp8_utils:", e)
for name, (k, n) in {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}.items():
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    wq = quantize_fp8(w, (128, 128)); wd, ws = wq.data.contiguous(), wq.scale.contiguous(); wt = wd.t(); sb = row_major_padded_t(ws)
    for m in (64, 256):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        r = {"proj": name, "m": m}
        r["bf16"] = graph_us(lambda: F.linear(x, w))
        r["quant"] = graph_us(lambda: quant.quantize_1x128(x, False))
        xq = quant.quantize_1x128(x, False)
        r["cublaslt_mm"] = graph_us(lambda: mm(xq.data, wt, xq.scale, sb, torch.bfloat16))
        r["ours_total"] = graph_us(lambda: mm(quant.quantize_1x128(x, False).data, wt, xq.scale, sb, torch.bfloat16))
        if vops is not None:
            try:
                sa = xq.scale.contiguous()  # (M, K/128) row-major
                out = vops.cutlass_scaled_mm(xq.data, wt, scale_a=sa, scale_b=ws.t().contiguous().t() if False else ws.t(), out_dtype=torch.bfloat16)
                ref = mm(xq.data, wt, xq.scale, sb, torch.bfloat16)
                r["cutlass_vs_cublaslt_maxdiff"] = float((out.float() - ref.float()).abs().max())
                r["cutlass_mm"] = graph_us(lambda: vops.cutlass_scaled_mm(xq.data, wt, scale_a=sa, scale_b=ws.t(), out_dtype=torch.bfloat16))
            except Exception as e:
                r["cutlass_err"] = f"{type(e).__name__}: {str(e)[:160]}"
        if w8a8_block_fp8_matmul is not None:
            try:
                r["vllm_triton_mm"] = graph_us(lambda: w8a8_block_fp8_matmul(xq.data, wd, xq.scale.contiguous(), ws, [128, 128], output_dtype=torch.bfloat16))
            except Exception as e:
                r["vllm_triton_err"] = f"{type(e).__name__}: {str(e)[:160]}"
        if per_token_group_quant_fp8 is not None and m == 256 and name == "qkv":
            try:
                xx = x * torch.exp(torch.randn(m, 1, device="cuda"))
                q, s = per_token_group_quant_fp8(xx, 128)
                ref = quantize_fp8(xx, (1, 128))
                r["vllm_quant_bytes_equal"] = bool(torch.equal(q.view(torch.uint8), ref.data.view(torch.uint8)))
                r["vllm_quant_scale_equal"] = bool(torch.equal(s.float().reshape(ref.scale.shape), ref.scale))
                r["vllm_quant_us"] = graph_us(lambda: per_token_group_quant_fp8(x, 128))
            except Exception as e:
                r["vllm_quant_err"] = f"{type(e).__name__}: {str(e)[:160]}"
        rows.append(r); print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
Path("/tmp/res/decode_gemm_probe.json").write_text(json.dumps(rows, indent=1))
