"""The WGrad padding of the Triton quantizer kernels and the one-read dual quantizer against the two kernels it
replaces (with its first-use check), run in Triton's CPU interpreter (`TRITON_INTERPRET=1`), the dual quantizer taking
a 1x128 result its producer kept, and the output layout the fused SwiGLU backward picks for a stacked gate/up GEMM
(its launch intercepted).

The interpreter's FP8 arithmetic is not the GPU's (its bytes differ from the reference quantizer's in places), so
this does not replace the byte-exact GPU tests (tests/gpu/test_wgrad_padding_gpu.py). It checks what the padding
itself must do, which no GPU is needed for: a kernel run with `pad_to` writes its unpadded result, then zeros, in
every column, including columns whose scale is NaN or inf. Needs Triton importable (`make test` runs it with
Triton from .liger-site/); the kernels run in a subprocess because TRITON_INTERPRET is read when they are defined.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (make test puts it on the path)")

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import json, torch
from jetrl_precision.kernels import quant
from jetrl_precision.kernels.layout import pad_columns
from jetrl_precision.quantize import quantize_fp8

g = torch.Generator().manual_seed(1)
out = []
for rows in (200, 16):
    x = (torch.randn(rows, 256, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))).to(torch.bfloat16)
    x[0, 0] = float("inf")          # its 1x128 group quantizes to NaN: NaN scales in the requantizer's columns
    x[rows - 1, 200] = float("nan")  # a NaN amax in the 128x1 quantizer's column 200
    q1 = quantize_fp8(x, (1, 128), nonfinite="propagate")
    for pow2 in (False, True):
        for name, fn in (("quantize_128x1_t", lambda p: quant.quantize_128x1_t(x, pow2, pad_to=p)),
                         ("requantize_t", lambda p: quant.requantize_1x128_to_128x1(q1, True, pow2, kernel="triton", pad_to=p))):
            plain, padded = fn(0), fn(128)
            want = pad_columns(plain, 128)
            out.append({"kernel": name, "rows": rows, "pow2": pow2, "shape": list(padded.data.shape),
                        "diff": int((padded.data.view(torch.uint8) != want.data.view(torch.uint8)).sum()),
                        "scales_same": bool(torch.equal(padded.scale.nan_to_num(7.0), plain.scale.nan_to_num(7.0))),
                        "nan_scale": bool(torch.isnan(plain.scale).any())})
print(json.dumps(out))
"""


def test_padded_outputs_are_the_unpadded_ones_then_zeros():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    r = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(rows) == 8
    for row in rows:
        assert row["shape"][1] % 128 == 0 and row["diff"] == 0 and row["scales_same"], row
    assert any(row["nan_scale"] for row in rows), "the NaN-scale columns this checks were not produced"


_DUAL_SCRIPT = r"""
import json, torch
from jetrl_precision.kernels import quant

g = torch.Generator().manual_seed(2)
out = []
for rows, cols in ((200, 256), (16, 200)):  # rows past a 128-row block; columns past a 128-column group
    x = (torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))).to(torch.bfloat16)
    x[:, 3] *= 500.0                   # an outlier column: its 128x1 groups take a large scale
    x[0, 0] = float("inf")
    x[rows - 1, cols - 1] = float("nan")
    for pow2, pad in ((False, 0), (True, 0), (False, 128)):
        q, qt = quant.quantize_dual_1x128_128x1_t(x, pow2, pow2, pad_to=pad)
        q_ref, qt_ref = quant.quantize_1x128(x, pow2), quant.quantize_128x1_t(x, pow2, pad_to=pad)
        same = lambda a, b: bool(torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
                                 and torch.equal(a.scale.nan_to_num(7.0), b.scale.nan_to_num(7.0))
                                 and a.scale.stride() == b.scale.stride() and a.block == b.block)
        out.append({"shape": [rows, cols], "pow2": pow2, "pad": pad, "rows": same(q, q_ref), "cols": same(qt, qt_ref),
                    "t_shape": list(qt.data.shape)})
refused = []
for fn in (lambda: quant.quantize_dual_1x128_128x1_t(x, pad_to=256), lambda: quant.quantize_128x1_t(x, pad_to=256)):
    try:  # 16 rows padded to 256: past their one 128-row block, which no program would write
        fn()
    except ValueError as e:
        refused.append(str(e))
out.append({"refused": refused})

# the first-use check JETRL_DUAL_QUANT_FUSED=1 runs: passes on these kernels, fails on one that flips a byte
from jetrl_precision.kernels import impl, quant_cuda
small = [t[:130, :200] for t in quant_cuda.probe_inputs(torch.bfloat16, torch.device("cpu"))[3:]]  # the GPU's are large
probe = {"ok": impl._one_read_dual_ok(torch.device("cpu"), False, False, 128, small)}
real = quant.quantize_dual_1x128_128x1_t


def broken(x, *args, **kwargs):
    q, qt = real(x, *args, **kwargs)
    qt.data.view(torch.uint8)[0, 0] ^= 1
    return q, qt


quant.quantize_dual_1x128_128x1_t = broken
probe["broken"] = impl._one_read_dual_ok(torch.device("cpu"), True, True, 128, small)
probe["reason"] = impl._dual_reasons.get(("cpu", True, True, 128), "")
out.append(probe)
print(json.dumps(out))
"""


def test_one_read_dual_quantizer_writes_what_the_two_kernels_write():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    r = subprocess.run([sys.executable, "-c", _DUAL_SCRIPT], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    *rows, refused, probe = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(rows) == 6 and len(refused["refused"]) == 2 and all("past their last 128-row block" in e for e in refused["refused"])
    assert probe["ok"] and not probe["broken"] and "its 128x1^T layout differs from the two kernels'" in probe["reason"], probe
    for row in rows:
        assert row["rows"] and row["cols"], row
        assert row["t_shape"][1] == (-(-row["shape"][0] // 128) * 128 if row["pad"] else row["shape"][0]), row


def test_swiglu_backward_writes_stacked_halves_for_a_stacked_gate_up():
    """gate/up as the halves of one stacked GEMM output (grouped.py): the kernel is asked to write d(gate) and d(up)
    as the halves of one new tensor, the stacked GEMM's dY without a copy; inputs laid out apart get outputs apart.
    (Its libdevice exp has no interpreter version: the launch is intercepted and its operands checked; the kernel's
    bytes are the GPU test's, tests/gpu/test_swiglu_gpu.py.)"""
    import torch

    from jetrl_precision.kernels import fused, launch

    rows, cols = 40, 384
    gu = torch.randn(rows, 2 * cols).to(torch.bfloat16)
    dh = torch.randn(rows, cols).to(torch.bfloat16)
    seen = []
    with launch.override_launches(lambda name, grid, args, meta: seen.append(args)):
        dg, du = fused.silu_mul_backward(dh, gu[:, :cols], gu[:, cols:])
        apart = fused.silu_mul_backward(dh, gu[:, :cols].contiguous(), gu[:, cols:].contiguous())
    assert dg.untyped_storage().data_ptr() == du.untyped_storage().data_ptr()
    assert du.storage_offset() == dg.storage_offset() + cols and dg.stride() == du.stride() == (2 * cols, 1)
    args = seen[0]
    assert args[3] is dg and args[4] is du and args[13:17] == (2 * cols, 1, 2 * cols, 1)  # the strides it writes with
    assert apart[0].untyped_storage().data_ptr() != apart[1].untyped_storage().data_ptr() and apart[0].is_contiguous()


_TAKE_SCRIPT = r"""
import json, torch
from jetrl_precision.kernels import impl, quant

x = (torch.randn(200, 256, generator=torch.Generator().manual_seed(4)) * 3).to(torch.bfloat16)
t = impl.TritonQuantizeImpl()
dual = t.bind_quantize_dual((1, 128), False, (128, 1), False, torch.device("cpu"))
mine = quant.quantize_1x128(x)                 # what a producer (the SwiGLU backward) kept for x
t._kept_dy.put(x, ((1, 128), False), mine)
q1, qt1 = dual(x)
q2, qt2 = dual(x)                               # taken: the kept result is not kept past its one consumer
same = lambda a, b: bool(torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale))
print(json.dumps({"took": q1 is mine, "second_fresh": q2 is not mine and same(q2, mine), "t_same": same(qt1, qt2),
                  "t_ref": same(qt1, quant.quantize_128x1_t(x)), "emptied": t._kept_dy.value is None,
                  "other_tensor": dual(x.clone())[0] is not mine}))
"""


def test_dual_quantizer_takes_a_kept_1x128_result_once():
    """The backward's dual quantizer takes a 1x128 result its producer kept for that very dY (the fused SwiGLU
    backward's), computes only the 128x1^T layout, and forgets the kept result (dY has one consumer)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    r = subprocess.run([sys.executable, "-c", _TAKE_SCRIPT], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {
        "took": True, "second_fresh": True, "t_same": True, "t_ref": True, "emptied": True, "other_tensor": True}

_RMSNORM_BWD_SCRIPT = r"""
import json, torch
from jetrl_precision.kernels import fused

g = torch.Generator().manual_seed(3)
out = []
for rows, cols, programs in ((37, 256, 5), (16, 200, None), (3, 128, 8), (9, 384, 1)):
    x = (torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))).to(torch.bfloat16)
    x[:, 5] *= 40.0  # an outlier column: it dominates its rows' rms
    w = (1 + 0.3 * torch.randn(cols, generator=g)).to(torch.bfloat16)
    dy = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
    dx, dw = fused.rmsnorm_backward(dy, x, w, 1e-5, programs=programs)
    dx1, dw1 = fused.rmsnorm_backward(dy, x, w, 1e-5, programs=1)
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    (wd * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5))).backward(dy.double())
    # What autograd through transformers' bf16 formula gets, for scale.
    xh, wh = x.clone().requires_grad_(), w.clone().requires_grad_()
    xf = xh.float()
    (wh * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)).backward(dy)
    rel = lambda a, ref: float((a.double() - ref).abs().max() / ref.abs().max())
    out.append({"shape": [rows, cols], "dtypes": [str(dx.dtype), str(dw.dtype)], "dx": rel(dx, xd.grad), "dw": rel(dw, wd.grad),
                "dx_hf": rel(xh.grad, xd.grad), "dw_hf": rel(wh.grad, wd.grad),
                "dx_same_any_programs": bool(torch.equal(dx, dx1)), "dw_programs": rel(dw1, dw.double())})
empty = fused.rmsnorm_backward(torch.empty(0, 256).bfloat16(), torch.empty(0, 256).bfloat16(), torch.ones(256).bfloat16())
out.append({"empty": [list(empty[0].shape), float(empty[1].abs().sum())]})
print(json.dumps(out))
"""


def test_rmsnorm_backward_kernel_against_float64():
    """The fused RMSNorm backward (kernels.fused.rmsnorm_backward) within bf16's rounding of the float64 gradients
    (as close as autograd through transformers' bf16 formula gets, within a factor of 3), dx the same bits however
    the rows are split among programs, dweight's partial sums agreeing to fp32 rounding."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    r = subprocess.run([sys.executable, "-c", _RMSNORM_BWD_SCRIPT], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    *rows, empty = json.loads(r.stdout.strip().splitlines()[-1])
    assert empty["empty"] == [[0, 256], 0.0]
    for row in rows:
        assert row["dtypes"] == ["torch.bfloat16", "torch.bfloat16"], row
        assert row["dx"] <= 2 ** -6 and row["dw"] <= 2 ** -6, row  # a couple of bf16 ulps of the largest entry
        assert row["dx"] <= 3 * row["dx_hf"] + 2 ** -9 and row["dw"] <= 3 * row["dw_hf"] + 2 ** -9, row
        assert row["dx_same_any_programs"] and row["dw_programs"] <= 2 ** -7, row
