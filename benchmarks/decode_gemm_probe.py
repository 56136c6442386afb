"""Decode-size FP8 GEMM options on the GPU, each timed under a CUDA graph (one engine step's GEMM, no host cost).

    python benchmarks/decode_gemm_probe.py

Compares, for the Llama-3.1-8B projections at M = 64 and 256: BF16 F.linear; our 1x128 quantizer + cuBLASLt
blockwise scaled_mm (what the jetrl_fp8 engine runs); vLLM's CUTLASS blockwise kernel (when vLLM is importable;
timing only: the scale layout passed to it is not verified); and whether vLLM's per-token-group quantizer gives
our bytes. Writes /tmp/res/decode_gemm_probe.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_gemm_triton import graph_us  # noqa: E402  (one CUDA-graph timer for both probes)
from jetrl_precision import quantize_fp8  # noqa: E402
from jetrl_precision.gemm import resolve_backend, torch_backend  # noqa: E402
from jetrl_precision.kernels import quant  # noqa: E402
from jetrl_precision.kernels.layout import row_major_padded_t  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def _vllm_ops():
    try:
        from vllm import _custom_ops as vops
    except Exception as e:  # noqa: BLE001 - optional
        print("no vllm ops:", e)
        vops = None
    try:
        from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8
    except Exception as e:  # noqa: BLE001 - optional
        print("no vllm fp8_utils:", e)
        per_token_group_quant_fp8 = None
    return vops, per_token_group_quant_fp8


def main() -> None:
    resolve_backend("torch", "cuda")
    mm = torch_backend.prepared_scaled_mm("cuda")
    vops, group_quant = _vllm_ops()
    rows = []
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq = quantize_fp8(w, (128, 128))
        ws = wq.scale.contiguous()
        wt, sb = wq.data.contiguous().t(), row_major_padded_t(ws)
        for m in (64, 256):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq = quant.quantize_1x128(x, False)
            r = {"proj": name, "m": m}
            r["bf16"] = graph_us(lambda: F.linear(x, w))
            r["quant"] = graph_us(lambda: quant.quantize_1x128(x, False))
            r["cublaslt_mm"] = graph_us(lambda: mm(xq.data, wt, xq.scale, sb, torch.bfloat16))
            r["ours_total"] = graph_us(lambda: mm(quant.quantize_1x128(x, False).data, wt, xq.scale, sb, torch.bfloat16))
            if vops is not None:
                try:
                    sa = xq.scale.contiguous()
                    out = vops.cutlass_scaled_mm(xq.data, wt, scale_a=sa, scale_b=ws.t(), out_dtype=torch.bfloat16)
                    r["cutlass_vs_cublaslt_maxdiff"] = float((out.float() - mm(xq.data, wt, xq.scale, sb, torch.bfloat16).float()).abs().max())
                    r["cutlass_mm"] = graph_us(lambda: vops.cutlass_scaled_mm(xq.data, wt, scale_a=sa, scale_b=ws.t(), out_dtype=torch.bfloat16))
                except Exception as e:  # noqa: BLE001 - reported, not fatal
                    r["cutlass_err"] = f"{type(e).__name__}: {str(e)[:160]}"
            if group_quant is not None and m == 256 and name == "qkv":
                try:
                    xx = x * torch.exp(torch.randn(m, 1, device="cuda"))
                    q, s = group_quant(xx, 128)
                    ref = quantize_fp8(xx, (1, 128))
                    r["vllm_quant_bytes_equal"] = bool(torch.equal(q.view(torch.uint8), ref.data.view(torch.uint8)))
                    r["vllm_quant_scale_equal"] = bool(torch.equal(s.float().reshape(ref.scale.shape), ref.scale))
                    r["vllm_quant_us"] = graph_us(lambda: group_quant(x, 128))
                except Exception as e:  # noqa: BLE001 - reported, not fatal
                    r["vllm_quant_err"] = f"{type(e).__name__}: {str(e)[:160]}"
            rows.append(r)
            print(json.dumps({key: (round(v, 2) if isinstance(v, float) else v) for key, v in r.items()}), flush=True)
    Path("/tmp/res").mkdir(parents=True, exist_ok=True)
    Path("/tmp/res/decode_gemm_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
