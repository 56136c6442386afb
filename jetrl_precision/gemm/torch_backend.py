"""The `torch` backend: cuBLASLt blockwise FP8 through `torch.nn.functional.scaled_mm` (sm90).

Layouts (cuBLASLt on an H200 with torch 2.11):
- mat_a = A e4m3 [M, K] row-major; mat_b = B.t() with B e4m3 [N, K] contiguous;
- 1x128 scales (A always; B for WGrad): shape (rows, K/128), strides (1, rows) (MN-major);
- 128x128 scale_b: shape (round_up(K/128, 4), N/128), strides (1, round_up(K/128, 4));
- fast accumulation is refused with block scales (block scaling promotes to fp32 every 128 K anyway);
- M must be a multiple of 4 (M = 1 and 130 give CUBLAS_STATUS_NOT_SUPPORTED), so A is padded.
The recipe enum is looked up through `__members__` (its spelling differs across torch versions);
torch builds without `F.scaled_mm` use the legacy `torch._scaled_mm`, which infers the recipe from
the scale shapes. The prepared calls (a layer's step plan, the inference engine) take the entry point with
the least host time whose bits equal F.scaled_mm's on the device: the legacy call for 1x128.128x128, else
`torch._scaled_mm_v2` with the arguments F.scaled_mm builds (without the wrapper's per-call list building); with
JETRL_NATIVE_GEMM=1 the C++ extension's call with a plan per shape first (`cublaslt_native`; opt-in until measured),
with JETRL_CUBLASLT_PLAN=1 a cuBLASLt plan from Python (`cublaslt`; opt-in: no host time saved at decode size).
K or N that are not multiples of 128 are zero-padded (logged once).
"""

from __future__ import annotations

import torch

from ..formats import QuantizedTensor
from ..kernels._probe import device_key
from ..kernels.layout import mn_major, pad_operands, row_major_padded_t
from . import cublaslt, cublaslt_native
from .dispatch import GemmBackend, PreparedGemm, register_backend

__all__ = ["torch_gemm_nt", "scaling_types", "prepared_scaled_mm", "TorchPreparedGemm"]


def _norm(name: str) -> str:
    return name.lower().replace("_", "")


_TYPES: list = []


def scaling_types() -> tuple[object, object] | None:
    """(BlockWise1x128, BlockWise128x128) members of F.ScalingType, or None if this torch has no such enum."""
    if _TYPES:
        return _TYPES[0]
    st = getattr(torch.nn.functional, "ScalingType", None)
    found = None
    if st is not None and hasattr(torch.nn.functional, "scaled_mm"):
        members = getattr(st, "__members__", None) or {m.name: m for m in st}  # pybind enums are not iterable
        by_norm = {_norm(k): v for k, v in members.items()}
        one, block = by_norm.get("blockwise1x128"), by_norm.get("blockwise128x128")
        if one is not None and block is not None:
            found = (one, block)
    _TYPES.append(found)
    return found


def _check_blocks(a: QuantizedTensor, b: QuantizedTensor, who: str) -> None:
    if a.block != (1, 128) or b.block not in ((128, 128), (1, 128)):
        raise ValueError(
            f"{who} GEMM supports A 1x128 x B 128x128 (fprop/dgrad) or A 1x128 x B 1x128 (wgrad) along K; "
            f"got A {a.block} and B {b.block}. Use gemm_backend='emulated' for other granularities."
        )


def torch_gemm_nt(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
    _check_blocks(a, b, "the torch")
    # cuBLASLt refuses (CUBLAS_STATUS_NOT_SUPPORTED) an MN-major scale_a whose M is not a multiple of 4.
    a_data, a_scale, b_data, b_scale, m, n = pad_operands(a, b, m_mult=4, who="torch backend")
    sa = mn_major(a_scale)
    sb = row_major_padded_t(b_scale) if b.block == (128, 128) else mn_major(b_scale)
    types = scaling_types()
    if types is None or (b.block == (128, 128) and _legacy_same.get(device_key(a_data.device), False)):
        # The legacy entry point infers the recipe from the scale shapes; where the probe found it
        # bitwise equal to F.scaled_mm it is taken for 1x128.128x128, because it costs less host time
        # per call, which decode-sized GEMMs feel.
        out = torch._scaled_mm(a_data, b_data.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    else:
        one, block = types
        rec_b = block if b.block == (128, 128) else one
        out = torch.nn.functional.scaled_mm(a_data, b_data.t(), sa, one, sb, rec_b, output_dtype=out_dtype)
    if out.shape[0] != m:
        out = out[:m]
    return out if out.shape[1] == n else out[:, :n]


def prepared_scaled_mm(device: torch.device | str):
    """The scaled_mm call `torch_gemm_nt` makes for 1x128 x 128x128 on `device`, for callers that prepare the
    operands themselves (an inference engine's static weights): fn(a_data, b_data_t, scale_a, scale_b, out_dtype)
    with scale_a MN-major (M a multiple of 4) and scale_b from `row_major_padded_t`. Of the entry points whose bits
    equal F.scaled_mm's on the device, the one with the least host time: the legacy `torch._scaled_mm`, else
    `torch._scaled_mm_v2` called with the arguments F.scaled_mm builds (its Python wrapper costs several
    microseconds per call), else F.scaled_mm; before them, where asked for and checked, the C++ extension's call
    with a plan per shape (JETRL_NATIVE_GEMM=1, `cublaslt_native`) or a cuBLASLt plan from Python
    (JETRL_CUBLASLT_PLAN=1, `cublaslt.blockwise_gemm`)."""
    reason = unavailable_reason(torch.device(device))
    if reason is not None:
        raise RuntimeError(f"the torch GEMM backend cannot run on {device}: {reason}")
    return _planned(device, "128x128", _torch_call_block(device))


def _torch_call_block(device: torch.device | str):
    types = scaling_types()
    if types is None or _legacy_same.get(device_key(device), False):

        def legacy(a, b_t, sa, sb, out_dtype):
            return torch._scaled_mm(a, b_t, scale_a=sa, scale_b=sb, out_dtype=out_dtype)

        return legacy
    one, block = types
    if _v2_block_same.get(device_key(device), False):
        return _v2_call(one, block)

    def blockwise(a, b_t, sa, sb, out_dtype):
        return torch.nn.functional.scaled_mm(a, b_t, sa, one, sb, block, output_dtype=out_dtype)

    return blockwise


def _planned(device: torch.device | str, block_b: str, call):
    """`call` (torch's entry point for 1x128 x `block_b`), or the plan-per-shape GEMM asked for in its place."""
    native = cublaslt_native.blockwise_gemm(device, "1x128", block_b, call)
    if native is not None:
        return native
    lt = cublaslt.blockwise_gemm(device, "1x128", block_b)
    return lt if lt is not None else call


def prepared_scaled_mm_1x128(device: torch.device | str):
    """The scaled_mm call `torch_gemm_nt` makes for 1x128 x 1x128 (WGrad) on `device`: fn(a, b_t, sa, sb, out_dtype),
    both scales MN-major. Where the probe found it bitwise equal, `torch._scaled_mm_v2` called with the arguments
    `F.scaled_mm` builds (the same op, without the wrapper's per-call list building), else F.scaled_mm; the
    plan-per-shape GEMMs before them as for `prepared_scaled_mm`."""
    reason = unavailable_reason(torch.device(device))
    if reason is not None:
        raise RuntimeError(f"the torch GEMM backend cannot run on {device}: {reason}")
    types = scaling_types()
    if types is None:
        raise RuntimeError(f"torch {torch.__version__} has no F.scaled_mm: 1x128 x 1x128 needs it")
    one = types[0]
    if _v2_same.get(device_key(device), False):
        return _planned(device, "1x128", _v2_call(one, one))

    def wrapped(a, b_t, sa, sb, out_dtype):
        return torch.nn.functional.scaled_mm(a, b_t, sa, one, sb, one, output_dtype=out_dtype)

    return _planned(device, "1x128", wrapped)


def _v2_call(recipe_a, recipe_b):
    """fn(a, b_t, sa, sb, out_dtype): `torch._scaled_mm_v2` with the arguments F.scaled_mm builds for these recipes
    (no swizzle, no bias, no contraction dims, no fast accumulation), the codes computed once."""
    code_a, code_b = [_enum_int(recipe_a)], [_enum_int(recipe_b)]

    def v2(a, b_t, sa, sb, out_dtype):
        return torch._scaled_mm_v2(a, b_t, [sa], code_a, [], [sb], code_b, [], None, out_dtype, [], False)

    return v2


def _enum_int(member) -> int:
    return member.value if hasattr(member, "value") else int(member)


class TorchPreparedGemm(PreparedGemm):
    """cuBLASLt blockwise with a layer's weight operands derived once: W^T as a view and its scales in the padded
    layout cuBLASLt reads (`row_major_padded_t`), and the scaled_mm entry point chosen once per device. Operands
    that need padding (M not a multiple of 4; K, N or the WGrad token count not multiples of 128) or a copy
    (non-contiguous data) go through `torch_gemm_nt`, which does it."""

    wgrad_k_multiple = 128  # cuBLASLt's blockwise K

    def __init__(self, device: torch.device) -> None:
        super().__init__("torch")
        self.mm = prepared_scaled_mm(device)
        # A torch without F.scaled_mm has no 1x128 x 1x128 entry point: WGrad then goes through torch_gemm_nt, which
        # says what is missing when it is called.
        self.mm_1x128 = prepared_scaled_mm_1x128(device) if scaling_types() is not None else None

    def weight(self, w: QuantizedTensor) -> object:
        n, k = w.shape
        if w.block != (128, 128) or n % 128 or k % 128 or not w.data.is_contiguous():
            return None
        return w.data.t(), row_major_padded_t(w.scale)

    def nt_weight(self, a: QuantizedTensor, prepared: object, w: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
        data = a.data
        if prepared is None or data.shape[0] % 4 or a.block != (1, 128) or not data.is_contiguous():
            return torch_gemm_nt(a, w, out_dtype)
        w_t, sb = prepared
        return self.mm(data, w_t, mn_major(a.scale), sb, out_dtype)

    def nt(self, a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
        ad, bd = a.data, b.data
        if (
            self.mm_1x128 is None or a.block != (1, 128) or b.block != (1, 128) or ad.shape[0] % 4 or ad.shape[1] % 128
            or bd.shape[0] % 128 or not ad.is_contiguous() or not bd.is_contiguous()
        ):
            return torch_gemm_nt(a, b, out_dtype)
        return self.mm_1x128(ad, bd.t(), mn_major(a.scale), mn_major(b.scale), out_dtype)


_probe: dict[str, str | None] = {}
# device -> whether torch._scaled_mm gives F.scaled_mm's exact bits for 1x128.128x128 (set by the probe).
_legacy_same: dict[str, bool] = {}
# device -> whether torch._scaled_mm_v2, called as F.scaled_mm calls it, gives its exact bits for 1x128.1x128.
_v2_same: dict[str, bool] = {}
# device -> the same for 1x128.128x128 (the forward's and DGrad's GEMM, and the engine's).
_v2_block_same: dict[str, bool] = {}


def _probe_device(device: torch.device) -> str | None:
    """Run both recipes once on a small problem and check them against the emulated product."""
    from ..quantize import quantize_fp8

    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(64, 256, generator=g).to(device)
    w = torch.randn(256, 256, generator=g).to(device)
    try:
        for bq in (quantize_fp8(w, (128, 128)), quantize_fp8(w, (1, 128))):
            aq = quantize_fp8(x, (1, 128))
            ref = aq.dequantize() @ bq.dequantize().t()
            got = torch_gemm_nt(aq, bq, torch.float32)
            err = float((got - ref).norm() / ref.norm())
            if not err < 1e-3:
                return f"blockwise scaled_mm gave a wrong result on this build (rel err {err:.2e} for B {bq.block})"
        _legacy_same[device_key(device)] = _legacy_matches(aq, quantize_fp8(w, (128, 128)))
        _v2_same[device_key(device)] = _v2_matches(aq, quantize_fp8(w, (1, 128)))
        _v2_block_same[device_key(device)] = _v2_matches(aq, quantize_fp8(w, (128, 128)))
    except Exception as e:  # noqa: BLE001 - the message is the reason shown to the user
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"blockwise torch scaled_mm is not supported here ({type(e).__name__}: {msg}); it needs sm90 and cuBLASLt >= 12.9"
    return None


def _legacy_matches(aq: QuantizedTensor, bq: QuantizedTensor) -> bool:
    """Whether torch._scaled_mm reproduces F.scaled_mm's bits for 1x128.128x128 on this build."""
    if scaling_types() is None:
        return False
    one, block = scaling_types()
    sa, sb = mn_major(aq.scale), row_major_padded_t(bq.scale)
    try:
        ref = torch.nn.functional.scaled_mm(aq.data, bq.data.t(), sa, one, sb, block, output_dtype=torch.bfloat16)
        legacy = torch._scaled_mm(aq.data, bq.data.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    except Exception:  # noqa: BLE001 - the legacy path is only an optimization
        return False
    return bool(torch.equal(ref, legacy))


def _v2_matches(aq: QuantizedTensor, bq: QuantizedTensor) -> bool:
    """Whether torch._scaled_mm_v2, called with the arguments F.scaled_mm builds in torch 2.11-2.13 (`_v2_call`),
    reproduces F.scaled_mm's bits for 1x128 x `bq`'s blocks (1x128 or 128x128) on this build (another signature
    raises, and the wrapper is kept)."""
    types = scaling_types()
    if types is None or not hasattr(torch, "_scaled_mm_v2"):
        return False
    one, block = types
    rec_b, sb = (block, row_major_padded_t(bq.scale)) if bq.block == (128, 128) else (one, mn_major(bq.scale))
    sa = mn_major(aq.scale)
    try:
        ref = torch.nn.functional.scaled_mm(aq.data, bq.data.t(), sa, one, sb, rec_b, output_dtype=torch.bfloat16)
        v2 = _v2_call(one, rec_b)(aq.data, bq.data.t(), sa, sb, torch.bfloat16)
    except Exception:  # noqa: BLE001 - the direct call is only an optimization
        return False
    return bool(torch.equal(ref, v2))


def unavailable_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"needs a CUDA device, got {device.type}"
    if not torch.cuda.is_available():
        return "CUDA is not available in this torch build or machine"
    if not hasattr(torch, "float8_e4m3fn") or not (hasattr(torch.nn.functional, "scaled_mm") or hasattr(torch, "_scaled_mm")):
        return f"torch {torch.__version__} has no FP8 scaled_mm"
    cap = torch.cuda.get_device_capability(device)
    if cap[0] != 9:
        return f"blockwise 1x128/128x128 scaled_mm is validated on sm90 (Hopper) only; this GPU is sm{cap[0]}{cap[1]}"
    key = str(device)
    if key not in _probe:
        _probe[key] = _probe_device(device)
    return _probe[key]


register_backend(GemmBackend("torch", torch_gemm_nt, unavailable_reason, TorchPreparedGemm))
