"""The `deep_gemm` backend: DeepGEMM's sm90 FP8 kernels, used when `deep_gemm` (or vLLM's vendored
`vllm.third_party.deep_gemm`) imports. Optional: nothing requires it.

Checked against DeepGEMM 2.6.1 (54e22612); `fp8_gemm_nt(a=(data, sf), b=(data, sf), d, c=None, recipe=None,
recipe_a=None, recipe_b=None, compiled_dims="nk", disable_ue8m0_cast=False)` computes D = C + A @ B^T:
- fprop / dgrad: recipe (1, 128, 128) (the sm90 default, passed explicitly): A 1x128, B 128x128, the
  1D2D kernel, bf16 D only and no C. An fp32 output request goes to the torch backend instead (logged once).
- wgrad: recipe (1, 1, 128) (both operands 1x128 along K): the 1D1D kernel, fp32 D only and C required
  (it TMA-adds into D). D starts at zero and is passed as C too; a bf16 request is cast from that fp32.
  Where cuBLASLt blockwise works, WGrad goes there instead (logged once): it writes bf16 directly and
  is faster on the H200; the 1D1D path serves GPUs without it (M >= 64).
Scale layouts it reads without a copy, which are the ones built here: 1x128 scales fp32 (rows, K/128)
MN-major with the row count padded to a multiple of 4 (16-byte TMA alignment; any other layout costs a
JIT transpose kernel or a torch copy inside DeepGEMM); 128x128 scales fp32 (N/128, K/128) row-major (or
its transpose). On sm90 fp32 scales are never rounded to UE8M0; `disable_ue8m0_cast=True` is passed
anyway, since the Jet-RL contract is plain fp32 amax/448 scales.
K and N are padded to multiples of 128 when needed (logged once). Any M works for 1D2D; 1D1D needs M >= 64.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from types import ModuleType
from typing import Iterator

import torch

from ..formats import QuantizedTensor
from ..kernels.layout import pad_operands
from .dispatch import NOT_INSTALLED, GemmBackend, PreparedGemm, register_backend

__all__ = ["deep_gemm_gemm_nt", "deep_gemm_wgrad_1d1d", "import_deep_gemm", "missing_reason", "DeepGemmPreparedGemm"]

logger = logging.getLogger(__name__)
_module: list[ModuleType | None] = []
_import_error: list[str] = []
_logged: set[str] = set()


def import_deep_gemm() -> ModuleType | None:
    """The deep_gemm module (site-packages first, then vLLM's vendored copy), or None."""
    if _module:
        return _module[0]
    errors = []
    mod = None
    try:
        import deep_gemm as mod  # type: ignore[no-redef]
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable"
        errors.append(("deep_gemm", e))
        try:
            with _attention_flags_kept():
                from vllm.third_party import deep_gemm as mod  # type: ignore[no-redef]
        except Exception as e2:  # noqa: BLE001
            errors.append(("vllm.third_party.deep_gemm", e2))
            mod = None
    if mod is not None and not hasattr(mod, "fp8_gemm_nt"):
        errors.append((mod.__name__, AttributeError("no fp8_gemm_nt (DeepGEMM older than 2.0?)")))
        mod = None
    _module.append(mod)
    if mod is None:
        absent = all(_not_found(what, e) for what, e in errors)
        detail = ("neither deep_gemm nor vLLM's copy imports" if absent
                  else "; ".join(f"import {what}: {type(e).__name__}: {e}" for what, e in errors))
        _import_error.append(f"{NOT_INSTALLED} ({detail}): build a wheel with examples/scripts/build_deep_gemm.sh, "
                             "see docs/performance.md")
    else:
        _import_error.append("")
    return mod


@contextlib.contextmanager
def _attention_flags_kept() -> Iterator[None]:
    """Importing vLLM (for its copy of DeepGEMM) switches torch's cuDNN SDPA off process-wide (vllm/platforms/cuda.py),
    which would send a training process's attention to a slower kernel for want of a GEMM library: put it back."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        yield
    finally:
        if torch.backends.cuda.cudnn_sdp_enabled() != before:
            torch.backends.cuda.enable_cudnn_sdp(before)
            logger.info("jetrl_precision: importing vLLM's DeepGEMM switched torch's cuDNN attention off; switched back on")


def _not_found(what: str, e: Exception) -> bool:
    """The import failed because the module is not there (not because a build of it is broken)."""
    if isinstance(e, ModuleNotFoundError):
        return e.name is None or what.startswith(e.name) or e.name.startswith(what.split(".")[0])
    return isinstance(e, ImportError) and "cannot import name 'deep_gemm'" in str(e)


def missing_reason() -> str | None:
    """None when deep_gemm imports; else one line: what failed and how to get DeepGEMM."""
    return None if import_deep_gemm() is not None else _import_error[0]


_kw_support: dict[str, bool] = {}


def _supports_kw(fn, name: str) -> bool:
    """Whether `fn` takes keyword `name`; cached (this runs per GEMM, and pybind functions hide their
    signature from inspect, so their docstring, which pybind11 opens with it, is read instead)."""
    key = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__name__', fn)}:{name}"
    if key not in _kw_support:
        try:
            _kw_support[key] = name in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            _kw_support[key] = f"{name}:" in (getattr(fn, "__doc__", None) or "")
    return _kw_support[key]


def _call(dg: ModuleType, a, b, d, **kw) -> None:
    fn = dg.fp8_gemm_nt
    if _supports_kw(fn, "disable_ue8m0_cast"):
        kw["disable_ue8m0_cast"] = True
    fn(a, b, d, **kw)


def _tma_mn_major(scale: torch.Tensor) -> torch.Tensor:
    """1x128 scales (R, G) as DeepGEMM reads them without a copy: strides (1, round_up(R, 4)).

    The Triton quantizers' (G, R) buffers already are this when R % 4 == 0; otherwise the values move
    into a (G, round_up(R, 4)) buffer (small: 4 bytes per 128 elements).
    """
    r, g = scale.shape
    rp = -(-r // 4) * 4
    if scale.dtype == torch.float32 and scale.stride(0) == 1 and scale.stride(1) == rp:
        return scale
    buf = torch.empty((g, rp), dtype=torch.float32, device=scale.device)
    buf[:, :r] = scale.t()
    return buf[:, :r].t()


def _sm90_sfb(scale: torch.Tensor) -> torch.Tensor:
    """128x128 scales (NB, KB) in a layout DeepGEMM's sm90 check accepts: row-major or its transpose."""
    nb, kb = scale.shape
    if scale.dtype == torch.float32 and (
        (scale.stride(1) == 1 and scale.stride(0) == kb) or (scale.stride(0) == 1 and scale.stride(1) == nb)
    ):
        return scale
    return torch.empty((nb, kb), dtype=torch.float32, device=scale.device).copy_(scale)


_MIN_M_1D1D = 64
_cublaslt: dict[int, bool] = {}


def _cublaslt_ok(device: torch.device) -> bool:
    """Whether the torch (cuBLASLt blockwise) backend works on this GPU; cached per device."""
    if device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _cublaslt:
        from .torch_backend import unavailable_reason

        _cublaslt[idx] = unavailable_reason(torch.device("cuda", idx)) is None
    return _cublaslt[idx]


def _to_torch(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, key: str, why: str) -> torch.Tensor:
    """Shapes/outputs DeepGEMM does not cover go to cuBLASLt (logged once per reason)."""
    if key not in _logged:
        _logged.add(key)
        logger.info("deep_gemm backend: %s; using the torch backend for it", why)
    from .torch_backend import torch_gemm_nt

    return torch_gemm_nt(a, b, out_dtype)


def deep_gemm_gemm_nt(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
    if a.block != (1, 128) or b.block not in ((128, 128), (1, 128)):
        raise ValueError(f"the deep_gemm GEMM supports A 1x128 x B 128x128 or 1x128; got A {a.block} and B {b.block}")
    if b.block == (128, 128) and out_dtype != torch.bfloat16:
        # DeepGEMM's 1x128.128x128 kernel writes bf16 only; fp32 requests (CPU-style tests) go to cuBLASLt.
        return _to_torch(a, b, out_dtype, "fp32", f"{out_dtype} output requested for 1x128.128x128")
    if b.block == (1, 128):
        if _cublaslt_ok(a.data.device):
            # WGrad on cuBLASLt: it writes the bf16 dW that Fp8Linear asks for directly and is faster on the
            # H200 than DeepGEMM's 1D1D kernel, which writes fp32 only (zero-fill + cast).
            return _to_torch(a, b, out_dtype, "wgrad", "1x128.1x128 (WGrad) runs on cuBLASLt, which is faster")
        return deep_gemm_wgrad_1d1d(a, b, out_dtype)
    dg = _module_or_raise()
    a_data, a_scale, b_data, b_scale, m, n = pad_operands(a, b, who="deep_gemm backend")
    out = torch.empty((m, b_data.shape[0]), dtype=torch.bfloat16, device=a_data.device)
    _call(dg, (a_data, _tma_mn_major(a_scale)), (b_data, _sm90_sfb(b_scale)), out, recipe=(1, 128, 128))
    return out if out.shape[1] == n else out[:, :n]


def deep_gemm_wgrad_1d1d(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
    """1x128.1x128 on DeepGEMM's 1D1D kernel itself (the backend prefers cuBLASLt where it works)."""
    if a.shape[0] < _MIN_M_1D1D:
        # On the H200 the 1D1D kernel fails at M = 1 and passes at M = 64, 100 and 130.
        raise ValueError(f"deep_gemm 1D1D kernel: needs M >= {_MIN_M_1D1D}, got {a.shape[0]}; use gemm_backend='torch' or 'triton'")
    dg = _module_or_raise()
    # Contiguous data: the 1D1D kernel takes K as the row stride of A and B.
    a_data, a_scale, b_data, b_scale, m, n = pad_operands(a, b, who="deep_gemm backend")
    # It writes fp32 only and adds into D: zeros, passed as C as well.
    out = torch.zeros((m, b_data.shape[0]), dtype=torch.float32, device=a_data.device)
    _call(dg, (a_data, _tma_mn_major(a_scale)), (b_data, _tma_mn_major(b_scale)), out, c=out, recipe=(1, 1, 128))
    out = out if out_dtype == torch.float32 else out.to(out_dtype)
    return out if out.shape[1] == n else out[:, :n]


class DeepGemmPreparedGemm(PreparedGemm):
    """DeepGEMM's 1x128.128x128 kernel with a layer's weight operands (data, scales in the layout it reads) derived
    once and the keyword set resolved once; WGrad on the torch backend's prepared cuBLASLt call where that works
    (as `deep_gemm_gemm_nt` routes it). Everything else goes through `deep_gemm_gemm_nt`."""

    wgrad_k_multiple = 128  # `pad_operands` pads K to 128 on both of its WGrad routes

    def __init__(self, device: torch.device) -> None:
        super().__init__("deep_gemm")
        dg = _module_or_raise()
        self.fn = dg.fp8_gemm_nt
        self.kw = {"recipe": (1, 128, 128)}
        if _supports_kw(self.fn, "disable_ue8m0_cast"):
            self.kw["disable_ue8m0_cast"] = True
        self.wgrad = None
        if _cublaslt_ok(device):
            from .torch_backend import TorchPreparedGemm

            self.wgrad = TorchPreparedGemm(device)
            if "wgrad" not in _logged:
                _logged.add("wgrad")
                logger.info("deep_gemm backend: 1x128.1x128 (WGrad) runs on cuBLASLt, which is faster; using the torch backend for it")

    def weight(self, w: QuantizedTensor) -> object:
        n, k = w.shape
        if w.block != (128, 128) or n % 128 or k % 128 or not w.data.is_contiguous():
            return None
        return w.data, _sm90_sfb(w.scale)

    def nt_weight(self, a: QuantizedTensor, prepared: object, w: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
        data = a.data
        if prepared is None or out_dtype != torch.bfloat16 or a.block != (1, 128) or not data.is_contiguous():
            return deep_gemm_gemm_nt(a, w, out_dtype)
        out = torch.empty((data.shape[0], prepared[0].shape[0]), dtype=torch.bfloat16, device=data.device)
        self.fn((data, _tma_mn_major(a.scale)), prepared, out, **self.kw)
        return out

    def nt(self, a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
        if self.wgrad is not None and b.block == (1, 128):
            return self.wgrad.nt(a, b, out_dtype)
        return deep_gemm_gemm_nt(a, b, out_dtype)


def _module_or_raise() -> ModuleType:
    dg = import_deep_gemm()
    if dg is None:
        raise RuntimeError(_import_error[0])
    return dg


def unavailable_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"needs a CUDA device, got {device.type}"
    if not torch.cuda.is_available():
        return "CUDA is not available in this torch build or machine"
    cap = torch.cuda.get_device_capability(device)
    if cap[0] != 9:
        return f"this backend drives DeepGEMM's sm90 kernels; this GPU is sm{cap[0]}{cap[1]}"
    return missing_reason()


register_backend(GemmBackend("deep_gemm", deep_gemm_gemm_nt, unavailable_reason, DeepGemmPreparedGemm))
