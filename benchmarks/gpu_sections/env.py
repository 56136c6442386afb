"""Sections `env` (GPU, clocks, software versions, the backends `auto` can pick) and `copy` (device-to-device
copy bandwidth: the memory ceiling the quantizers are measured against)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from jetrl_precision import ops
from jetrl_precision.gemm import available_backends, resolve_backend
from jetrl_precision.quantize import quantize_fp8

from .timing import bench, rec, rel_err

__all__ = ["section_env", "section_copy"]


def section_env(args):
    import triton

    p = torch.cuda.get_device_properties(0)
    info = {"gpu": p.name, "sms": p.multi_processor_count, "mem_gib": round(p.total_memory / 2**30, 1),
            "cc": f"{p.major}.{p.minor}", "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    try:
        info["cublaslt"] = torch._C._cuda_getCompiledVersion()
    except Exception:  # noqa: BLE001
        pass
    try:
        q = "name,driver_version,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu"
        info["nvidia_smi"] = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001
        info["nvidia_smi"] = f"unavailable: {e}"
    info["backends"] = available_backends("cuda")
    info["auto"] = resolve_backend("auto", "cuda")
    info["quant_kernel"] = ops.kernel_name("cuda")
    # The torch backend's legacy torch._scaled_mm shortcut: what its probe decided, and why (the probe's own
    # problem replayed). It differs between machines of the same kind.
    from jetrl_precision.gemm import torch_backend as tb

    info["torch_legacy_shortcut"] = dict(tb._legacy_same)
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        xp, wp = torch.randn(64, 256, generator=g).cuda(), torch.randn(256, 256, generator=g).cuda()
        aq, bq = quantize_fp8(xp, (1, 128)), quantize_fp8(wp, (128, 128))
        out = tb.torch_gemm_nt(aq, bq, torch.bfloat16)  # whichever entry point the probe chose
        legacy = torch._scaled_mm(aq.data, bq.data.t(), scale_a=tb.mn_major(aq.scale),
                                  scale_b=tb.row_major_padded_t(bq.scale), out_dtype=torch.bfloat16)
        info["torch_legacy_probe_problem"] = "bitwise equal" if torch.equal(out, legacy) else (
            f"different, rel err {rel_err(legacy, out):.2e}")
    except Exception as e:  # noqa: BLE001
        info["torch_legacy_probe_problem"] = f"legacy call raised {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    print("ENV", json.dumps(info, indent=1))
    return info


def section_copy(args):
    n = 2**29  # 1 GiB of bf16
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src))
    bw = 2 * src.numel() * 2 / (t * 1e-3) / 1e12
    rec("d2d_copy_bandwidth", "1GiB bf16", "torch", round(bw, 3), "TB/s")
    print(f"copy: {bw:.2f} TB/s")
    del src, dst
    return bw
