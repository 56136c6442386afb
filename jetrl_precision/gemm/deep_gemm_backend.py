"""The `deep_gemm` backend: DeepGEMM's sm90 FP8 kernels, used when `deep_gemm` (or vLLM's vendored
`vllm.third_party.deep_gemm`) imports. Optional: nothing requires it.

- fprop / dgrad: `fp8_gemm_nt((A, sa), (B, sb), D)` with the default sm90 recipe (1, 128, 128):
  A 1x128 with MN-major fp32 scales (M, K/128), B 128x128 with row-major (N/128, K/128) scales,
  bf16 output only. An fp32 output request goes to the torch backend instead (logged once).
- wgrad: recipe (1, 1, 128) (both operands 1x128 along K); fp32 output accumulates into C, so D
  starts at zero and is passed as C too.
Scale floats are used as they are (`disable_ue8m0_cast=True` where the API has it): the Jet-RL
contract keeps plain fp32 amax/448 scales unless the recipe asks for pow2.
K and N are padded to multiples of 128 when needed (logged once).
"""

from __future__ import annotations

import inspect
import logging
from types import ModuleType

import torch

from ..formats import QuantizedTensor
from ..kernels.layout import mn_major, pad_operands
from .dispatch import GemmBackend, register_backend

__all__ = ["deep_gemm_gemm_nt", "import_deep_gemm"]

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
        errors.append(f"import deep_gemm: {type(e).__name__}: {e}")
        try:
            from vllm.third_party import deep_gemm as mod  # type: ignore[no-redef]
        except Exception as e2:  # noqa: BLE001
            errors.append(f"import vllm.third_party.deep_gemm: {type(e2).__name__}: {e2}")
            mod = None
    if mod is not None and not hasattr(mod, "fp8_gemm_nt"):
        errors.append(f"{mod.__name__} has no fp8_gemm_nt (DeepGEMM older than 2.0?)")
        mod = None
    _module.append(mod)
    _import_error.append("; ".join(errors))
    return mod


def _supports_kw(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pybind functions may hide their signature
        return False


def _call(dg: ModuleType, a, b, d, **kw) -> None:
    fn = dg.fp8_gemm_nt
    if _supports_kw(fn, "disable_ue8m0_cast"):
        kw["disable_ue8m0_cast"] = True
    try:
        fn(a, b, d, **kw)
    except TypeError:
        kw.pop("disable_ue8m0_cast", None)
        fn(a, b, d, **kw)


def deep_gemm_gemm_nt(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
    if a.block != (1, 128) or b.block not in ((128, 128), (1, 128)):
        raise ValueError(f"the deep_gemm GEMM supports A 1x128 x B 128x128 or 1x128; got A {a.block} and B {b.block}")
    if b.block == (128, 128) and out_dtype != torch.bfloat16:
        # DeepGEMM's 1x128.128x128 kernel writes bf16 only; fp32 requests (CPU-style tests) go to cuBLASLt.
        if "fp32" not in _logged:
            _logged.add("fp32")
            logger.info("deep_gemm backend: %s output requested for 1x128.128x128; using the torch backend for it", out_dtype)
        from .torch_backend import torch_gemm_nt

        return torch_gemm_nt(a, b, out_dtype)
    dg = import_deep_gemm()
    if dg is None:
        raise RuntimeError(f"deep_gemm is not importable: {_import_error[0]}")
    a_data, a_scale, b_data, b_scale, m, n = pad_operands(a, b, who="deep_gemm backend")
    sa = mn_major(a_scale)
    if b.block == (128, 128):
        sb = b_scale.contiguous()
        out = torch.empty((m, b_data.shape[0]), dtype=torch.bfloat16, device=a_data.device)
        _call(dg, (a_data, sa), (b_data, sb), out)
    else:
        sb = mn_major(b_scale)
        if out_dtype == torch.float32:
            out = torch.zeros((m, b_data.shape[0]), dtype=torch.float32, device=a_data.device)
            _call(dg, (a_data, sa), (b_data, sb), out, c=out, recipe=(1, 1, 128))
        else:
            out = torch.empty((m, b_data.shape[0]), dtype=torch.bfloat16, device=a_data.device)
            _call(dg, (a_data, sa), (b_data, sb), out, recipe=(1, 1, 128))
        out = out if out.dtype == out_dtype else out.to(out_dtype)
    return out if out.shape[1] == n else out[:, :n]


def unavailable_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"needs a CUDA device, got {device.type}"
    if not torch.cuda.is_available():
        return "CUDA is not available in this torch build or machine"
    cap = torch.cuda.get_device_capability(device)
    if cap[0] != 9:
        return f"this backend drives DeepGEMM's sm90 kernels; this GPU is sm{cap[0]}{cap[1]}"
    if import_deep_gemm() is None:
        return f"DeepGEMM is not installed ({_import_error[0]}); build it from github.com/deepseek-ai/DeepGEMM or install vLLM"
    return None


register_backend(GemmBackend("deep_gemm", deep_gemm_gemm_nt, unavailable_reason))
