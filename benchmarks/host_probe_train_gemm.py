"""Host time of one FP8 GEMM call at training sizes, by route, against BF16's mm.

    python benchmarks/host_probe_train_gemm.py [--m 64,4352,8192] [--samples 15]

An `Fp8Linear` training step calls three blockwise GEMMs (fprop, DGrad, WGrad) through `torch._scaled_mm`, which
builds cuBLASLt's descriptors and asks its heuristic on every call. This probe prices that call at training sizes
against the routes that make the plan once (what `gemm.cublaslt_native`, JETRL_NATIVE_GEMM=1, saves per call). Per
M, N = K = 4096, each route's calls queued behind a spin kernel (host time only), the routes taking turns sample by
sample:

  bf16 mm                        torch.mm of BF16 operands (what nn.Linear's three GEMMs cost)
  torch._scaled_mm fprop         1x128 activation x 128x128 weight, as the torch backend calls it
  gemm_nt torch fprop / wgrad    the torch backend's call (layouts, then torch._scaled_mm); WGrad is 1x128 x 1x128,
                                 both operands grouped along the tokens
  cuBLASLt plan fprop            gemm.cublaslt's plan (descriptors and algorithm made once, ctypes per call)
  cublasLtMatmul alone fprop     the library call with everything made once and the output preallocated
  native fprop / wgrad           the C++ extension's call with its plan per shape (`gemm.cublaslt_native`, what
                                 JETRL_NATIVE_GEMM=1 gives the torch backend), checked against torch's bits first

Each line prints min / median us per call. No vLLM needed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_probe_engine import paired_us  # noqa: E402

from jetrl_precision import quantize_fp8  # noqa: E402
from jetrl_precision.gemm import cublaslt, cublaslt_native, gemm_nt  # noqa: E402
from jetrl_precision.kernels import quant  # noqa: E402
from jetrl_precision.kernels.layout import mn_major, row_major_padded_t  # noqa: E402


def _refused(*args):
    raise RuntimeError("the native GEMM handed back an input it takes")


def routes(m: int, n: int = 4096, k: int = 4096) -> dict:
    """{name: zero-argument call} for one M: the operands made once, in the layouts the torch backend passes."""
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    xq, wq = quant.quantize_1x128(x, False), quantize_fp8(w, (128, 128))
    wt, sb = wq.data.t(), row_major_padded_t(wq.scale)
    sa = mn_major(xq.scale)
    # WGrad-shaped: both operands grouped along M (the tokens), K-major as the backward's quantizers write them
    dy_t = quant.quantize_128x1_t(torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16))
    x_t = quant.quantize_128x1_t(x)
    out = {
        "bf16 mm": lambda: torch.mm(x, w.t()),
        "torch._scaled_mm fprop": lambda: torch._scaled_mm(xq.data, wt, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16),
        "gemm_nt torch fprop": lambda: gemm_nt(xq, wq, torch.bfloat16, "torch"),
        "gemm_nt torch wgrad": lambda: gemm_nt(dy_t, x_t, torch.bfloat16, "torch"),
    }
    native = {b: cublaslt_native.blockwise_gemm("cuda", "1x128", b, _refused) for b in ("128x128", "1x128")}
    if None in native.values():
        print(f"  native GEMM: unavailable ({cublaslt_native._reasons})")
    else:
        out["native fprop"] = lambda: native["128x128"](xq.data, wt, sa, sb, torch.bfloat16)
        if m % 128 == 0:  # WGrad's K is the token count: the torch backend pads it to 128 before this call
            dy_d, x_d, dy_s, x_s = dy_t.data, x_t.data.t(), mn_major(dy_t.scale), mn_major(x_t.scale)
            same = torch.equal(native["1x128"](dy_d, x_d, dy_s, x_s, torch.bfloat16), gemm_nt(dy_t, x_t, torch.bfloat16, "torch"))
            print(f"  M={m}: native wgrad equals the torch backend's bit for bit: {same}")
            out["native wgrad"] = lambda: native["1x128"](dy_d, x_d, dy_s, x_s, torch.bfloat16)
    try:
        lt = cublaslt.LtBlockwiseGemm(torch.device("cuda"), "1x128", "128x128")
    except RuntimeError as e:
        print(f"  cuBLASLt plan: unavailable ({e})")
        return out
    ref = out["torch._scaled_mm fprop"]()
    got = lt(xq.data, wt, sa, sb, torch.bfloat16)
    print(f"  M={m}: cuBLASLt plan fprop equals torch._scaled_mm bit for bit: {torch.equal(got, ref)}")
    out["cuBLASLt plan fprop"] = lambda: lt(xq.data, wt, sa, sb, torch.bfloat16)
    plan = lt._plans[(m, n, k, torch.bfloat16)]
    y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    ptrs = (wt.data_ptr(), xq.data.data_ptr(), y.data_ptr())
    stream = torch.cuda.current_stream().cuda_stream
    ws = lt._ws_ptrs.get(stream) or lt._workspace(stream)
    la, lb, lc, ld = plan.layouts
    raw = lt.lib.cublasLtMatmul
    out["cublasLtMatmul alone fprop"] = lambda: raw(lt.handle, plan.desc, lt._alpha_addr, ptrs[0], la, ptrs[1], lb,
                                                    lt._beta_addr, ptrs[2], lc, ptrs[2], ld, plan.algo, ws, lt.ws_bytes, stream)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="64,4352,8192", help="token counts, comma-separated")
    ap.add_argument("--samples", type=int, default=15)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_probe_train_gemm: needs a CUDA device")
    os.environ[cublaslt_native.ENV_SWITCH] = "1"  # the native route is probed whatever the caller's environment says
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; host us per call, min / median over {a.samples} samples")
    for m in (int(v) for v in a.m.split(",") if v):
        pieces = routes(m)
        for name, (lo, med) in paired_us(pieces, samples=a.samples, reps=20).items():
            print(f"[host us min/median] M={m} {name} {lo} / {med}")


if __name__ == "__main__":
    main()
