"""Host (CPU) work of one FP8 linear step, counted on a machine without a GPU: the CUDA code path, kernels stubbed.

On the H200's host an eager `Fp8Linear` forward+backward costs several times `nn.Linear`'s host time, and at 8B
shapes the smaller projections wait on the host, not the GPU. What that time is made of can be counted anywhere:
this script runs the layer's CUDA code path on CPU tensors (the Triton quantize implementation, the CUDA
requantizer and the cuBLASLt `torch` GEMM backend), with every kernel launch and GEMM call replaced by a stub, and
counts per step:

  python_calls   Python function calls (sys.setprofile 'call' events): interpreter work between kernels
  builtin_calls  C functions called from Python ('c_call'): tensor.stride(), isinstance, dict.get, ...
  torch_calls    torch API calls from Python (a TorchFunctionMode): each crosses the binding and the dispatcher
  aten_ops       ops that reached the dispatcher's kernels (a TorchDispatchMode), views and factories included
  allocations    factory ops among them (empty, empty_strided, zeros, ...): caching-allocator calls on a GPU
  launches       GPU launches: Triton kernels, the CUDA requantizer, scaled_mm GEMMs (F.linear/mm for bf16)
  cpu_us         wall time per step with no-op stubs and no counters (CPU tensors: a rough guide only)

The counts are deterministic and comparable between revisions; the GPU's figure is `gpu_bench.py --sections linear`
(`linear_fwd_bwd_host_ms`). Beside the training steps it counts one call of an inference engine's FP8 linear
(`EngineLinear`, what an eager vLLM decode step pays per projection; the GPU's figure is `host_probe_engine.py`). With `--check`, the stubs compute what the kernels compute (the reference quantizer,
a float64 GEMM), and the step's outputs must equal the CPU reference path's bit for bit: the host-path logic
(plans, layouts, padding, buffer reuse) is checked without a GPU.

    python benchmarks/host_cost.py [--shapes 256x512x768,200x384x640] [--check] [--json out.json] [--top 25]

Without Triton installed, a stand-in `triton` module lets the kernel modules import (no kernel ever runs: every
launch is stubbed). Run it in its own process: it patches the device checks of the modules it measures.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib.util
import inspect
import json
import sys
import time
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

__all__ = ["HostCounts", "count_host_work", "simulated_cuda", "install_triton_stand_in", "linear_steps", "main"]


# ---- a stand-in for Triton where it is not installed -------------------------------------------------------
class _JitStandIn:
    """What `@triton.jit` returns here: the function's parameter names, and a launch that refuses to run."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.arg_names = list(inspect.signature(fn).parameters)

    def __getitem__(self, grid):
        raise RuntimeError(f"the Triton stand-in cannot launch {self.fn.__name__}: run it under launch.override_launches")


class _StandIn:
    """Any attribute, any call: what module-level Triton code (decorators, dtypes, configs) needs to import."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> "_StandIn":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _StandIn(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return _JitStandIn(args[0])  # a decorator (@triton.jit, @triton.autotune(...)(fn))
        return _StandIn(f"{self._name}(...)")

    def __repr__(self) -> str:
        return f"<triton stand-in {self._name}>"


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _StandIn(f"{self.__name__}.{attr}")


def install_triton_stand_in() -> bool:
    """Make `import triton` work without Triton (True if the stand-in was installed, False if Triton is there)."""
    if "triton" in sys.modules or importlib.util.find_spec("triton") is not None:
        return False
    # torch decides once whether Triton exists (and imports it for torch.compile's runtime): let it find none first.
    import torch._dynamo  # noqa: F401
    from torch.utils._triton import has_triton

    has_triton()
    mods = {}
    for name in ("triton", "triton.language", "triton.language.extra", "triton.language.extra.libdevice",
                 "triton.language.extra.cuda", "triton.language.extra.cuda.libdevice", "triton.testing"):
        mods[name] = sys.modules[name] = _StandInModule(name)
    mods["triton"].__version__ = "0.0+stand-in"
    mods["triton"].jit = _StandIn("triton.jit")
    mods["triton"].next_power_of_2 = lambda n: 1 << (int(n) - 1).bit_length()
    mods["triton"].cdiv = lambda a, b: -(-a // b)
    for name, mod in mods.items():
        if "." in name:
            parent, child = name.rsplit(".", 1)
            setattr(mods[parent], child, mod)
    return True


# ---- counting -----------------------------------------------------------------------------------------------
_FACTORIES = {"empty", "empty_strided", "zeros", "ones", "full", "new_empty", "new_empty_strided", "new_zeros",
              "new_ones", "new_full", "empty_like", "zeros_like", "ones_like", "full_like", "scalar_tensor"}


@dataclass
class HostCounts:
    python_calls: int = 0
    builtin_calls: int = 0
    torch_calls: int = 0
    aten_ops: int = 0
    allocations: int = 0
    launches: int = 0
    launch_names: dict[str, int] = field(default_factory=dict)
    aten_names: dict[str, int] = field(default_factory=dict)
    python_functions: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict:
        return {k: v for k, v in asdict(self).items() if not isinstance(v, dict)}


_THIS_FILE = str(Path(__file__).resolve())


class _Counter:
    """The counters of one measurement; `paused` while a stub runs (stub work is not the step's host work)."""

    def __init__(self) -> None:
        self.c = HostCounts()
        self.paused = 0
        self.active = False
        self.py = collections.Counter()
        self.aten = collections.Counter()
        self.launch: dict[str, int] = {}

    def profile(self, frame, event, arg):
        if self.paused or not self.active:
            return
        if event == "call":
            code = frame.f_code
            if code.co_filename == _THIS_FILE:  # the measurement's own frames (step lambdas, stubs)
                return
            self.c.python_calls += 1
            self.py[f"{Path(code.co_filename).name}:{code.co_name}"] += 1
        elif event == "c_call":
            self.c.builtin_calls += 1

    def launched(self, name: str) -> None:
        if self.active and not self.paused:
            self.c.launches += 1
            self.launch[name] = self.launch.get(name, 0) + 1

    def finish(self) -> HostCounts:
        self.c.python_functions = dict(self.py.most_common())
        self.c.aten_names = dict(self.aten.most_common())
        self.c.launch_names = dict(self.launch)
        return self.c


_COUNTER: list[_Counter | None] = [None]


class _TorchCalls(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        c = _COUNTER[0]
        if c is not None and c.active and not c.paused:
            c.c.torch_calls += 1
        return func(*args, **(kwargs or {}))


class _AtenOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        c = _COUNTER[0]
        if c is not None and c.active and not c.paused:
            c.c.aten_ops += 1
            name = func.overloadpacket.__name__
            c.aten[name] += 1
            if name in _FACTORIES:
                c.c.allocations += 1
        return func(*args, **(kwargs or {}))


def _counted(step: Callable[[], object], how: str) -> _Counter:
    counter = _Counter()
    _COUNTER[0] = counter
    try:
        if how == "python":
            sys.setprofile(counter.profile)
            counter.active = True
            try:
                step()
            finally:
                counter.active = False
                sys.setprofile(None)
        else:
            with (_TorchCalls() if how == "torch" else _AtenOps()):
                counter.active = True
                try:
                    step()
                finally:
                    counter.active = False
    finally:
        _COUNTER[0] = None
    return counter


def count_host_work(step: Callable[[], object], warmup: int = 2) -> HostCounts:
    """Run `step` `warmup` times, then three more times, each under one kind of counter (Python calls, torch API
    calls, aten ops), so that no counter counts another's machinery. Steps must repeat the same work (the
    measured ones alternate two inputs; each pass is one step) and run on the calling thread (CPU autograd does).
    """
    for _ in range(warmup):
        step()
    py, tf, at = (_counted(step, how) for how in ("python", "torch", "aten"))
    out = py.finish()
    out.torch_calls = tf.c.torch_calls
    out.aten_ops, out.allocations = at.c.aten_ops, at.c.allocations
    out.aten_names = dict(at.aten.most_common())
    return out


def cpu_us(step: Callable[[], object], n: int = 30, warmup: int = 3) -> float:
    """Median wall time per step in us (no counters)."""
    for _ in range(warmup):
        step()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[n // 2] * 1e6


# ---- the kernels, stubbed -----------------------------------------------------------------------------------
def _strided(t: torch.Tensor, shape, strides) -> torch.Tensor:
    return torch.as_strided(t, tuple(shape), tuple(strides), t.storage_offset())


def _swiglu_grads(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What autograd computes for silu(gate) * up: the bytes both fused SwiGLU backward kernels must give."""
    return torch.ops.aten.silu_backward(dh * up, gate), dh * F.silu(gate)


def _emulate_triton(name: str, grid, args, meta) -> None:
    """What each Triton kernel of jetrl_precision.kernels writes, from the reference quantizer (exact bytes)."""
    from jetrl_precision.formats import QuantizedTensor
    from jetrl_precision.quantize import quantize_fp8, requantize_fp8

    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    if name == "_quant_1x128_kernel":
        x, q, s, r, c, sxr, sxc, sqr, sqc, ssr, ssg = args
        ref = quantize_fp8(_strided(x, (r, c), (sxr, sxc)), (1, 128), pow2_scale=meta["POW2"], nonfinite="propagate")
        _strided(q, (r, c), (sqr, sqc)).copy_(ref.data)
        _strided(s, (r, cdiv(c, 128)), (ssr, ssg)).copy_(ref.scale)
    elif name == "_quant_128x1_kernel":
        x, in_s, q, s, r, c, sxr, sxc, sir, sig, sqr, sqc, ssb, ssc, r_out = args
        xv = _strided(x, (r, c), (sxr, sxc))
        if r_out > r:  # the padded rows of a transposed WGrad operand: zeros
            _strided(q, (r_out, c), (sqr, sqc)).zero_()
        if meta["DEQ"]:
            src = QuantizedTensor(xv, _strided(in_s, (r, cdiv(c, 128)), (sir, sig)), (1, 128))
            ref = requantize_fp8(src, (128, 1), pow2_scale=meta["POW2"])
        else:
            ref = quantize_fp8(xv, (128, 1), pow2_scale=meta["POW2"], nonfinite="propagate")
        _strided(q, (r, c), (sqr, sqc)).copy_(ref.data)
        _strided(s, (cdiv(r, 128), c), (ssb, ssc)).copy_(ref.scale)
    elif name == "_quant_128x128_kernel":
        x, q, qt, s, st, r, c, sxr, sxc, sqr, sqc, stqr, stqc, ssr, ssc, stsr, stsc = args
        ref = quantize_fp8(_strided(x, (r, c), (sxr, sxc)), (128, 128), pow2_scale=meta["POW2"], nonfinite="propagate")
        rb, cb = cdiv(r, 128), cdiv(c, 128)
        if meta["WRITE_Q"]:
            _strided(q, (r, c), (sqr, sqc)).copy_(ref.data)
            _strided(s, (rb, cb), (ssr, ssc)).copy_(ref.scale)
        if meta["WRITE_T"]:
            _strided(qt, (c, r), (stqr, stqc)).copy_(ref.data.t())
            _strided(st, (cb, rb), (stsr, stsc)).copy_(ref.scale.t())
    elif name == "_transpose_u8_kernel":
        x, y, r, c, sxr, sxc, syr, syc = args
        _strided(y, (c, r), (syr, syc)).copy_(_strided(x, (r, c), (sxr, sxc)).t())
    elif name == "_silu_mul_quant_kernel":
        g, u, h, q, s, r, c, sgr, sgc, sur, suc, shr, shc, sqr, sqc, ssr, ssg = args
        hp = F.silu(_strided(g, (r, c), (sgr, sgc))) * _strided(u, (r, c), (sur, suc))
        if meta["WRITE_H"]:
            _strided(h, (r, c), (shr, shc)).copy_(hp)
        ref = quantize_fp8(hp, (1, 128), pow2_scale=meta["POW2"], nonfinite="propagate")
        _strided(q, (r, c), (sqr, sqc)).copy_(ref.data)
        _strided(s, (r, cdiv(c, 128)), (ssr, ssg)).copy_(ref.scale)
    elif name == "_silu_mul_bwd_kernel":  # autograd's bytes for silu(gate) * up, as the device probe requires
        dh, g, u, dg, du, r, c, sdr, sdc, sgr, sgc, sur, suc, sdgr, sdgc, sdur, sduc = args
        gd, gu = _swiglu_grads(_strided(dh, (r, c), (sdr, sdc)), _strided(g, (r, c), (sgr, sgc)), _strided(u, (r, c), (sur, suc)))
        _strided(dg, (r, c), (sdgr, sdgc)).copy_(gd)
        _strided(du, (r, c), (sdur, sduc)).copy_(gu)
    elif name == "_silu_mul_bwd_quant_kernel":
        dh, g, u, d, q, s, r, c, sdr, sgr, sur, sd, sq, ssr, ssg = args
        gd, gu = _swiglu_grads(_strided(dh, (r, c), (sdr, 1)), _strided(g, (r, c), (sgr, 1)), _strided(u, (r, c), (sur, 1)))
        dv = _strided(d, (r, 2 * c), (sd, 1))
        dv[:, :c].copy_(gd)
        dv[:, c:].copy_(gu)
        ref = quantize_fp8(dv, (1, 128), pow2_scale=meta["POW2"], nonfinite="propagate")
        _strided(q, (r, 2 * c), (sq, 1)).copy_(ref.data)
        _strided(s, (r, 2 * c // 128), (ssr, ssg)).copy_(ref.scale)
    elif name == "_rmsnorm_quant_kernel":
        x, w, y, q, s, r, c, eps, sxr, syr, sqr, ssr, ssg = args
        from jetrl_precision.rmsnorm import rms_norm_formula

        hp = rms_norm_formula(_strided(x, (r, c), (sxr, 1)), w, eps)  # the eager formula: the reference path's bytes
        if meta["WRITE_Y"]:
            _strided(y, (r, c), (syr, 1)).copy_(hp)
        ref = quantize_fp8(hp, (1, 128), pow2_scale=meta["POW2"], nonfinite="propagate")
        _strided(q, (r, c), (sqr, 1)).copy_(ref.data)
        _strided(s, (r, cdiv(c, 128)), (ssr, ssg)).copy_(ref.scale)
    elif name == "_rmsnorm_bwd_kernel":
        dy, x, w, dx, dw, r, c, eps, _, sdyr, sxr, sdxr = args
        from jetrl_precision.rmsnorm import formula_grads

        # autograd's gradients of the formula (the reference path's bytes; the kernel's own differ in rounding):
        # dx, and dweight as the first program's partial sum, the others' zero.
        gx, gw = formula_grads(_strided(x, (r, c), (sxr, 1)), w, eps, _strided(dy, (r, c), (sdyr, 1)), (True, True))
        _strided(dx, (r, c), (sdxr, 1)).copy_(gx)
        dw.zero_()
        dw[0].copy_(gw.float())
    elif name == "quant_1x128_rows":  # kernels.quant_cuda
        x, q, s, m, k, ldx, ldq_words, lds = args
        ref = quantize_fp8(_strided(x, (m, k), (ldx, 1)), (1, 128), pow2_scale=meta.get("POW2", False), nonfinite="propagate")
        _strided(q, (m, k), (4 * ldq_words, 1)).copy_(ref.data)
        _strided(s, (m, cdiv(k, 128)), (1, lds)).copy_(ref.scale)
    elif name == "requant_1x128_to_128x1_t":
        x, s_in, q, s_out, m, k, ldx_words, s_row, s_grp, ldq, m_out = args
        src = QuantizedTensor(_strided(x, (m, k), (4 * ldx_words, 1)), _strided(s_in, (m, cdiv(k, 128)), (s_row, s_grp)), (1, 128))
        ref = requantize_fp8(src, (128, 1), pow2_scale=meta.get("POW2", False)).t()
        _strided(q, (k, m_out), (ldq, 1)).zero_()
        _strided(q, (k, m), (ldq, 1)).copy_(ref.data)
        _strided(s_out, (k, cdiv(m, 128)), (1, k)).copy_(ref.scale)
    else:
        raise NotImplementedError(f"host_cost: no CPU emulation of kernel {name!r}")


def _b_operand(b_t: torch.Tensor, sb: torch.Tensor, block_b: str):
    """B [N, K] and its logical scales from scaled_mm's (mat_b = B^T, scale_b) for the two recipes."""
    from jetrl_precision.formats import QuantizedTensor

    b = b_t.t()
    n, k = b.shape
    if block_b == "128x128":  # scale_b (round_up(KB, 4), NB), strides (1, round_up(KB, 4))
        return QuantizedTensor(b, sb.t()[:, : -(-k // 128)], (128, 128))
    return QuantizedTensor(b, sb, (1, 128))  # (N, KG), MN-major


def _emulated_mm(a, b_t, sa, sb, out_dtype, block_b: str) -> torch.Tensor:
    from jetrl_precision.formats import QuantizedTensor

    aq = QuantizedTensor(a, sa, (1, 128))
    bq = _b_operand(b_t, sb, block_b)
    return (aq.dequantize(torch.float64) @ bq.dequantize(torch.float64).t()).to(out_dtype)


class _GemmStubs:
    """torch._scaled_mm, F.scaled_mm and torch._scaled_mm_v2 replaced: counted as launches; in check mode they
    return the float64 product of the dequantized operands (the `emulated` backend's numbers), else an empty
    output."""

    def __init__(self, check: bool) -> None:
        self.check = check
        self.saved: dict[str, object] = {}

    def _run(self, name, a, b_t, sa, sb, out_dtype, block_b):
        c = _COUNTER[0]
        if c is not None:
            c.launched(name)
            c.paused += 1
        try:
            if self.check:
                return _emulated_mm(a, b_t, sa, sb, out_dtype, block_b)
            return torch.empty((a.shape[0], b_t.shape[1]), dtype=out_dtype)
        finally:
            if c is not None:
                c.paused -= 1

    def legacy(self, a, b_t, scale_a=None, scale_b=None, out_dtype=None, **kw):
        # jetrl_precision takes the legacy entry point for 1x128 x 128x128 only (it refuses 1x128 x 1x128).
        return self._run("torch._scaled_mm", a, b_t, scale_a, scale_b, out_dtype, "128x128")

    def scaled_mm(self, a, b_t, sa, rec_a, sb, rec_b, *args, output_dtype=torch.bfloat16, **kw):
        return self._run("F.scaled_mm", a, b_t, sa, sb, output_dtype, "128x128" if "128x128" in str(rec_b) else "1x128")

    def v2(self, a, b_t, sa, rec_a, swz_a, sb, rec_b, swz_b, bias, out_dtype, contraction_dim, fast_accum):
        block = F.ScalingType.BlockWise128x128.value if hasattr(F.ScalingType.BlockWise128x128, "value") else None
        block_b = "128x128" if block is not None and list(rec_b) == [block] else "1x128"
        return self._run("torch._scaled_mm_v2", a, b_t, sa[0] if isinstance(sa, (list, tuple)) else sa,
                         sb[0] if isinstance(sb, (list, tuple)) else sb, out_dtype, block_b)

    def __enter__(self):
        self.saved = {"legacy": torch._scaled_mm, "scaled_mm": F.scaled_mm, "v2": getattr(torch, "_scaled_mm_v2", None)}
        torch._scaled_mm = self.legacy
        F.scaled_mm = self.scaled_mm
        if self.saved["v2"] is not None:
            torch._scaled_mm_v2 = self.v2
        return self

    def __exit__(self, *exc):
        torch._scaled_mm = self.saved["legacy"]
        F.scaled_mm = self.saved["scaled_mm"]
        if self.saved["v2"] is not None:
            torch._scaled_mm_v2 = self.saved["v2"]


@contextlib.contextmanager
def simulated_cuda(check: bool = False) -> Iterator[None]:
    """Run jetrl_precision's CUDA code path on CPU tensors, every launch stubbed (see the module docstring).

    Inside the block CPU devices pass the CUDA-only device checks of the Triton quantize implementation, the CUDA
    requantizer and the torch (cuBLASLt) GEMM backend. `check=True` makes the stubs compute the kernels' results.
    """
    install_triton_stand_in()
    from jetrl_precision import ops
    from jetrl_precision.gemm import dispatch, torch_backend
    from jetrl_precision.kernels import cast_transpose, launch, padding_probe, rmsnorm_probe, swiglu_probe
    from jetrl_precision.kernels.impl import TritonQuantizeImpl

    ops._load_optional()
    impl = TritonQuantizeImpl()
    impl._ok["cpu"] = True
    ops.register_quantize_impl(impl)
    dispatch._ensure_registered()
    saved_torch = dispatch._REGISTRY["torch"]
    dispatch._REGISTRY["torch"] = dataclasses.replace(saved_torch, unavailable_reason=lambda device: None)
    saved_reason = torch_backend.unavailable_reason
    torch_backend.unavailable_reason = lambda device: None
    saved_legacy, saved_v2 = dict(torch_backend._legacy_same), dict(torch_backend._v2_same)
    # The entry points the device probe picks on the H200: the legacy call for 1x128 x 128x128 (bitwise equal
    # there, torch 2.11), and torch._scaled_mm_v2 for 1x128 x 1x128 where it matches F.scaled_mm.
    torch_backend._legacy_same["cpu"] = True
    torch_backend._v2_same["cpu"] = True
    saved_ct = (cast_transpose.supported_shape, cast_transpose.kernel_for, dict(cast_transpose._usable))
    cast_transpose.supported_shape = cast_transpose.supported_layout  # the layout rules, on CPU tensors
    cast_transpose.kernel_for = lambda device, pow2: _NvrtcStub(cast_transpose.KERNEL_NAME, launch.launch_override, {"POW2": pow2})
    cast_transpose._usable["cpu"] = True
    # The padding probe's verdict where the kernels pad WGrad operands right (the emulation below is the reference,
    # and --check compares the padded path's bytes): the path the layers take then.
    saved_pad = dict(padding_probe._verdicts)
    padding_probe._verdicts["cpu"] = True
    # The fused norms' device probe passed (its checks read the kernels' results, which only --check computes).
    saved_norm = dict(rmsnorm_probe._verdicts)
    rmsnorm_probe._verdicts.update({("cpu", dt): True for dt in (torch.bfloat16, torch.float16, torch.float32)})
    # Likewise the fused SwiGLU backward's (both kernels: its emulation below gives autograd's bytes).
    saved_swiglu = dict(swiglu_probe._verdicts)
    swiglu_probe._verdicts.update({("cpu", dt, k): True for dt in (torch.bfloat16, torch.float16, torch.float32)
                                   for k in ("plain", "quantizing")})
    # The engine's CUDA 1x128 activation quantizer (kernels.quant_cuda), its launch going to the override like the
    # others; the engine's per-process choice of quantizer is made afresh inside the block and forgotten after it.
    from jetrl_precision.integrations import engine_linear
    from jetrl_precision.kernels import quant_cuda

    saved_qc = quant_cuda.quantizer_1x128
    quant_cuda.quantizer_1x128 = lambda device, pow2, dtype: (
        quant_cuda.Quantizer1x128(_NvrtcStub(quant_cuda.KERNEL_NAME, launch.launch_override), pow2, dtype)
        if dtype in (torch.bfloat16, torch.float16) else None)
    saved_act = dict(engine_linear._ACT_QUANTIZERS)
    engine_linear._ACT_QUANTIZERS.clear()

    def override(name, grid, args, meta):
        c = _COUNTER[0]
        if c is not None:
            c.launched(name)
        if check:
            if c is not None:
                c.paused += 1
            try:
                _emulate_triton(name, grid, args, meta)
            finally:
                if c is not None:
                    c.paused -= 1

    try:
        with _GemmStubs(check), launch.override_launches(override):
            yield
    finally:
        ops._IMPLS.remove(impl)
        dispatch._REGISTRY["torch"] = saved_torch
        torch_backend.unavailable_reason = saved_reason
        for table, saved in ((torch_backend._legacy_same, saved_legacy), (torch_backend._v2_same, saved_v2)):
            table.clear()
            table.update(saved)
        cast_transpose.supported_shape, cast_transpose.kernel_for = saved_ct[:2]
        cast_transpose._usable.clear()
        cast_transpose._usable.update(saved_ct[2])
        padding_probe._verdicts.clear()
        padding_probe._verdicts.update(saved_pad)
        rmsnorm_probe._verdicts.clear()
        rmsnorm_probe._verdicts.update(saved_norm)
        swiglu_probe._verdicts.clear()
        swiglu_probe._verdicts.update(saved_swiglu)
        quant_cuda.quantizer_1x128 = saved_qc
        engine_linear._ACT_QUANTIZERS.clear()
        engine_linear._ACT_QUANTIZERS.update(saved_act)


class _NvrtcStub:
    """Stands in for an `nvrtc.NvrtcKernel` taking CPU tensors (device index -1): its launch goes to the override,
    with `meta` (what the compiled kernel fixes, e.g. its POW2 template argument) beside the call's own."""

    device_index = -1

    def __init__(self, name: str, launch_override: Callable, meta: dict | None = None) -> None:
        self.name, self.launch_override, self.meta = name, launch_override, meta or {}

    def __call__(self, grid, threads, tensors, ints, meta=None):
        self.launch_override()(self.name, grid, (*tensors, *ints), {"threads": threads, **self.meta, **(meta or {})})


# ---- the steps measured -------------------------------------------------------------------------------------
def _data(shape, seed, scale=1.0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp(0.5 * torch.randn(shape[0], 1, generator=g))
    ch = torch.rand(shape[-1], generator=g) < 5e-3
    return (torch.where(ch[None, :], x * 20, x) * scale).to(dtype)


def linear_steps(m: int, k: int, n: int, backend: str = "torch", dtype=torch.bfloat16) -> dict[str, Callable]:
    """{label: step} for one projection: nn.Linear fwd+bwd, Fp8Linear fwd+bwd, Fp8Linear no-grad forward.

    Two inputs alternate, as in the GPU benchmark, so the quantizers' sibling-share cache never skips a step's work.
    """
    from jetrl_precision import Fp8Linear, get_recipe

    r = get_recipe("jet_fp8")
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=False, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(_data((n, k), 1, 0.02, dtype))
    f8 = Fp8Linear.from_linear(lin, r.train_fprop, r.train_backward, gemm_backend=backend)
    xs = [_data((m, k), 2 + i, dtype=dtype).requires_grad_(True) for i in range(2)]
    dys = [_data((m, n), 4 + i, 1e-3, dtype) for i in range(2)]
    i = [0]

    def nxt():
        i[0] ^= 1
        return i[0]

    def run(mod):
        j = nxt()
        lin.weight.grad = None
        xs[j].grad = None
        mod(xs[j]).backward(dys[j])

    def fwd_nograd():
        with torch.no_grad():
            return f8(xs[nxt()])

    return {"nn.Linear fwd+bwd": lambda: run(lin), "Fp8Linear fwd+bwd": lambda: run(f8),
            "Fp8Linear fwd no_grad": fwd_nograd, "_modules": (lin, f8, xs, dys)}


def engine_steps(m: int, k: int, n: int) -> dict[str, Callable]:
    """{label: step} for one call of an inference engine's FP8 linear (`EngineLinear`, the vLLM plugin's forward) on
    the prepared cuBLASLt path, against F.linear: what an eager decode step pays per projection."""
    from jetrl_precision import get_recipe, quantize_fp8
    from jetrl_precision.integrations.engine_linear import EngineLinear

    w = _data((n, k), 1, 0.02)
    wq = quantize_fp8(w, (128, 128))
    x = _data((m, k), 2)
    spec = get_recipe("jet_fp8").rollout.input
    built: list[EngineLinear] = []

    def call():
        if not built:  # at the first (warm-up) call, inside `simulated_cuda`: the engine derives its plan at load
            built.append(EngineLinear(wq.data, wq.scale, [(n, -(-n // 128), 128)], 128, spec, "torch"))
        return built[0](x)

    return {"F.linear (engine, bf16)": lambda: F.linear(x, w), "EngineLinear call": call}


def check_engine_bytes(m: int, k: int, n: int) -> list[str]:
    """The engine call on the simulated CUDA path (its prepared plan, the CUDA quantizer's launch into the activation
    workspace) against the general path's emulated GEMM, bit for bit: two layers of one K taking turns, at M, then
    at M + 5 (another view of the same workspace), then at M again."""
    from jetrl_precision import get_recipe, quantize_fp8
    from jetrl_precision.gemm import gemm_nt
    from jetrl_precision.integrations.engine_linear import EngineLinear

    wqs = [quantize_fp8(_data((n, k), seed, 0.02), (128, 128)) for seed in (1, 3)]
    problems = []
    with simulated_cuda(check=True):
        lins = [EngineLinear(wq.data, wq.scale, [(n, -(-n // 128), 128)], 128, get_recipe("jet_fp8").rollout.input, "torch")
                for wq in wqs]
        if not lins[0]._fast:
            return [f"engine M={m} K={k} N={n}: the prepared path was not built on the simulated CUDA path"]
        for rows in (m, m + 5, m):
            x = _data((rows, k), rows)
            for i, (lin, wq) in enumerate(zip(lins, wqs)):
                want = gemm_nt(quantize_fp8(x, (1, 128)), wq, torch.bfloat16, "emulated")
                got = lin(x)
                if got.shape != want.shape or not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                    problems.append(f"engine M={rows} K={k} N={n} layer {i}: the simulated engine call differs from the reference path")
    return problems


def check_bytes(m: int, k: int, n: int) -> list[str]:
    """Fp8Linear fwd+bwd on the simulated CUDA path (stubs computing the kernels' results) against the CPU
    reference path (reference quantizer + emulated GEMM): y, dX and dW must be equal bit for bit."""
    from jetrl_precision import Fp8Linear, get_recipe, mark_weights_updated

    r = get_recipe("jet_fp8")
    lin = nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(_data((n, k), 1, 0.02))
    x = _data((m, k), 2)
    dy = _data((m, n), 4, 1e-3)
    out = {}
    for label, backend, ctx in (("reference", "emulated", contextlib.nullcontext()), ("simulated", "torch", simulated_cuda(check=True))):
        with ctx:
            mark_weights_updated()
            layer = Fp8Linear.from_linear(lin, r.train_fprop, r.train_backward, gemm_backend=backend)
            res = []
            for _ in range(2):  # the second step runs on the cached weight and the built plan
                xx = x.clone().requires_grad_(True)
                lin.weight.grad = None
                y = layer(xx)
                y.backward(dy)
                res.append((y.detach(), xx.grad, lin.weight.grad))
            with torch.no_grad():
                res.append((layer(x), None, None))
        out[label] = res
    problems = []
    for i, (got, want) in enumerate(zip(out["simulated"], out["reference"])):
        for what, g, w in zip(("y", "dX", "dW"), got, want):
            if w is None:
                continue
            if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(g.view(-1).view(torch.int16), w.view(-1).view(torch.int16)):
                problems.append(f"M={m} K={k} N={n} step {i} {what}: simulated CUDA path differs from the reference")
    return problems


def _decoder_layer(fp8_backend: str | None, stacked: bool = True, fused_norms: bool = True):
    """One small Llama decoder layer (head dim 128), bf16; jet_fp8 with the fused SwiGLU MLP when a backend is given,
    q/k/v and gate/up as stacked GEMMs unless `stacked` is False, the norms fused with their consumers' quantization
    unless `fused_norms` is False."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_sections.llama_stack import MLP, RMSNorm, Stack

    from jetrl_precision import convert_to_fp8, get_recipe
    from jetrl_precision.rmsnorm import fuse_rmsnorm
    from jetrl_precision.swiglu import fuse_swiglu

    torch.manual_seed(0)
    model = Stack(n_layers=1, h=512, i=1024, nh=4, nkv=2).to(torch.bfloat16)
    for p in model.parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    if fp8_backend is not None:
        convert_to_fp8(model, dataclasses.replace(get_recipe("jet_fp8"), gemm_backend=fp8_backend), fuse_swiglu=False,
                       fuse_projections=stacked, fuse_rmsnorm=False)
        fuse_swiglu(model, classes=[MLP])  # what convert_to_fp8 does for HF Llama MLPs and norms
        if fused_norms:
            fuse_rmsnorm(model, classes=[RMSNorm])
    return model


def layer_steps(tokens: int = 256) -> dict[str, Callable]:
    """{label: step} for one Llama decoder layer (benchmarks/gpu_sections/llama_stack.py, head dim 128, small widths):
    fwd+bwd and the no-grad forward in bf16, in jet_fp8 as convert_to_fp8 installs it (fused SwiGLU MLP, stacked
    q/k/v and gate/up GEMMs, norms fused with their consumers' quantization), in jet_fp8 with each projection on its
    own GEMM and in jet_fp8 with the plain norms. The layer's bf16 ops (attention, norms, RoPE) run for real on CPU;
    the counts include their host work too."""
    xs = [_data((tokens, 512), 6 + i).view(1, tokens, 512).requires_grad_(True) for i in range(2)]
    i = [0]

    def step(model, params):
        i[0] ^= 1
        x = xs[i[0]]
        x.grad = None
        for p in params:
            p.grad = None
        model(x).float().pow(2).mean().backward()

    def forward(model):
        i[0] ^= 1
        with torch.no_grad():
            model(xs[i[0]])

    from jetrl_precision.grouped import projection_groups

    models = {"bf16": _decoder_layer(None), "jet_fp8": _decoder_layer("torch"),
              "jet_fp8 separate": _decoder_layer("torch", stacked=False),
              "jet_fp8 plain norms": _decoder_layer("torch", fused_norms=False)}
    # A group compares its first stacked GEMM with its members' own once (grouped.Fp8LinearGroup._check); the no-op
    # stubs compute nothing to compare, and the counts are of the steady state. check_layer_bytes runs that check.
    for group in (g for name in ("jet_fp8", "jet_fp8 plain norms") for g in projection_groups(models[name])):
        group._checked = True
    steps = {}
    for name, model in models.items():
        params = list(model.parameters())
        steps[f"decoder layer fwd+bwd {name}"] = lambda m=model, p=params: step(m, p)
    for name, model in models.items():
        steps[f"decoder layer fwd no_grad {name}"] = lambda m=model: forward(m)
    return steps


def check_layer_bytes(tokens: int = 200) -> list[str]:
    """A jet_fp8 decoder layer's fwd+bwd on the simulated CUDA path against the CPU reference path, bit for bit:
    output, input gradient and every weight gradient (sibling sharing and the fused SwiGLU quantization included)."""
    from jetrl_precision import mark_weights_updated

    x = _data((tokens, 512), 9).view(1, tokens, 512)
    out = {}
    for label, backend, ctx in (("reference", "emulated", contextlib.nullcontext()), ("simulated", "torch", simulated_cuda(check=True))):
        with ctx:
            mark_weights_updated()
            model = _decoder_layer(backend)
            xx = x.clone().requires_grad_(True)
            y = model(xx)
            y.float().pow(2).mean().backward()
            out[label] = {"y": y.detach(), "dX": xx.grad, **{n: p.grad for n, p in model.named_parameters()}}
    return [f"decoder layer ({tokens} tokens) {k}: simulated CUDA path differs from the reference"
            for k, want in out["reference"].items() if not torch.equal(out["simulated"][k], want)]


# An eager decode step's projection (M = 64 sequences; M = 3 takes the M-padded path).
ENGINE_SHAPES = ((64, 512, 768), (3, 512, 768))


def measure(shapes: list[tuple[int, int, int]], top: int = 0, layer_tokens: int = 0) -> list[dict]:
    rows = []
    work = [(f"M={m} K={k} N={n}", lambda m=m, k=k, n=n: linear_steps(m, k, n)) for m, k, n in shapes]
    work += [(f"engine M={m} K={k} N={n}", lambda m=m, k=k, n=n: engine_steps(m, k, n)) for m, k, n in ENGINE_SHAPES]
    if layer_tokens:
        work.append((f"{layer_tokens} tokens, hidden 512, MLP 1024", lambda: layer_steps(layer_tokens)))
    for shape, make in work:
        steps = make()
        with simulated_cuda(check=False):
            for label, step in steps.items():
                if label.startswith("_"):
                    continue
                counts = count_host_work(step)
                # With no-op stubs an FP8 step's wall time is host work only; nn.Linear's includes its CPU matmuls.
                us = round(cpu_us(step), 1) if label.startswith(("Fp8", "EngineLinear")) else None
                row = {"shape": shape, "step": label, **counts.summary(), "cpu_us": us,
                       "launch_names": counts.launch_names}
                if top:
                    row["top_python"] = dict(list(counts.python_functions.items())[:top])
                    row["aten_names"] = counts.aten_names
                rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="256x512x768,200x384x640", help="MxKxN, comma-separated")
    ap.add_argument("--check", action="store_true", help="also check the simulated path's bytes against the reference")
    ap.add_argument("--json", help="write the rows (and check problems) here")
    ap.add_argument("--top", type=int, default=0, help="also list the N most-called Python functions per step")
    ap.add_argument("--layer-tokens", type=int, default=256, help="also count one Llama decoder layer's step (0: no)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    rows = measure(shapes, a.top, a.layer_tokens)
    cols = ("python_calls", "builtin_calls", "torch_calls", "aten_ops", "allocations", "launches", "cpu_us")
    print(f"{'shape':32s} {'step':30s} " + " ".join(f"{c:>13s}" for c in cols))
    for r in rows:
        print(f"{r['shape']:32s} {r['step']:30s} " + " ".join(f"{'-' if r[c] is None else r[c]:>13}" for c in cols))
        if a.top:
            print("    launches: " + ", ".join(f"{k} x{v}" for k, v in r["launch_names"].items()))
            print("    aten: " + ", ".join(f"{k} x{v}" for k, v in r["aten_names"].items()))
            print("    python: " + ", ".join(f"{k} x{v}" for k, v in r["top_python"].items()))
    problems = []
    if a.check:
        for m, k, n in shapes:
            problems += check_bytes(m, k, n)
        for m, k, n in ENGINE_SHAPES:
            problems += check_engine_bytes(m, k, n)
        if a.layer_tokens:
            problems += check_layer_bytes()
        print("check: " + ("bytes equal to the reference path" if not problems else "\n  ".join(["FAILED"] + problems)))
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "check_problems": problems if a.check else None}, indent=1) + "\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
