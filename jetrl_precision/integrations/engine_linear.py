"""The FP8 linear forward of an inference engine: a static weight whose GEMM operands are derived once.

An engine's weights change only when the trainer syncs them, so what a forward derives from the
weight (the GEMM's scale layout, the backend, the fused parts' block grids) is computed at load
time and refreshed in place after each sync (`refresh`), keeping buffers that a captured CUDA graph
reads at the same addresses. Per call only the activation is quantized (1x128, the training
quantizer's bytes) and the GEMM runs: two launches on the cuBLASLt path. The activation quantizer there is
the CUDA kernel with the lean launch (`kernels.quant_cuda`) where it passed its first-use check, else the
Triton kernel: an eager decode step waits on the host time of these launches (`activation_quantizer`), so an
eager engine's decode-sized batches make both launches from one C++ call where it builds and matches these bits
(`engine_native`, asked for with `native=True`).

An engine may run a second backend for decode-sized batches (`decode_backend` for M <= `decode_max_m`): DeepGEMM
(`auto` under CUDA graphs, `gemm.resolve_decode_backend`) or vLLM's CUTLASS blockwise kernel (an eager engine that
asks for it, `vllm_cutlass`): the same FP8 operands, another kernel's accumulation, as between any two backends.

`EngineLinear.from_op_args` rebuilds the same object from the custom op's arguments, so the
compiled path (`torch.ops.jetrl.fp8_linear`) and the eager path run one implementation.

Layouts handled:
- one block grid (a plain projection, or fused parts whose rows tile one grid): one GEMM;
- fused parts with partial block rows (k/v of a GQA model with N % 128 != 0): one GEMM per part,
  as training runs them, concatenated;
- the output is always contiguous [M, N]: compiled graphs read it with the strides the op declares.
"""

from __future__ import annotations

import functools
import os
from typing import Sequence

import torch

from .. import ops
from ..formats import Granularity, QuantizedTensor
from ..gemm import gemm_nt
from ..recipe import TensorSpec

__all__ = ["EngineLinear", "activation_quantizer", "spec_code", "spec_from_code", "FUSED_DECODE", "FUSED_DECODE_MAX_M"]

# The decode backend that quantizes inside the GEMM (`kernels.quant_gemm`): one launch per projection, for eager
# engines, whose decode steps wait on host time. Up to 16 rows: there its GPU time is within a few us of the
# two-launch call's on the 8B projections; at 64 rows and more every program re-quantizing its rows costs 2-9x.
FUSED_DECODE = "triton_fused"
FUSED_DECODE_MAX_M = 16


def spec_code(spec: TensorSpec) -> str:
    """A TensorSpec as a string a custom op can take: "" for high precision, else "granularity|scale_rule"."""
    return f"{spec.granularity.value}|{spec.scale_rule.value}" if spec.is_fp8 else ""


def spec_from_code(code: str) -> TensorSpec:
    if not code:
        return TensorSpec()
    gran, rule = code.split("|")
    return TensorSpec("e4m3", gran, rule)


class EngineLinear:
    """y = x @ W^T for an e4m3 weight [N, K] stored as row groups with their own block grids.

    `groups` is a sequence of (rows, scale_rows, block_rows) per group; all groups share `block_cols`.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        groups: Sequence[tuple[int, int, int]],
        block_cols: int,
        input_spec: TensorSpec,
        backend: str,
        decode_backend: str = "",
        decode_max_m: int = 0,
        native: bool = False,
    ) -> None:
        self.weight, self.weight_scale = weight, weight_scale
        self.groups = tuple((int(r), int(sr), int(b0)) for r, sr, b0 in groups)
        self.block_cols = int(block_cols)
        self.input_spec = input_spec
        self.backend = backend
        # "" = `backend` at every M; else this backend for M <= decode_max_m (the plan's fast path only)
        self.decode_backend, self.decode_max_m = decode_backend or "", int(decode_max_m) if decode_backend else 0
        self.n, self.k = weight.shape
        b0s = {b0 for _, _, b0 in self.groups}
        # The groups tile one block grid when every part but the last fills whole block rows.
        self.one_grid = len(self.groups) == 1 or (len(b0s) == 1 and all(r % self.groups[0][2] == 0 for r, _, _ in self.groups[:-1]))
        self._fast = None
        # An eager engine asks for the native call (`engine_native`): decode-sized batches then quantize and multiply
        # in one C++ call, with the Python path's bits; everything else runs the Python path.
        self.native_asked, self._native = native, None
        self.refresh()

    @classmethod
    def from_op_args(cls, weight, weight_scale, group_rows, group_scale_rows, group_block_rows, block_cols, input_code, backend,
                     decode_backend="", decode_max_m=0):
        return cls(weight, weight_scale, list(zip(group_rows, group_scale_rows, group_block_rows)), block_cols, spec_from_code(input_code), backend,
                   decode_backend, decode_max_m)

    @property
    def op_args(self) -> tuple:
        """The custom op's arguments after (x, weight, weight_scale)."""
        rows, srows, b0s = (list(col) for col in zip(*self.groups))
        return (rows, srows, b0s, self.block_cols, spec_code(self.input_spec), self.backend, self.decode_backend, self.decode_max_m)

    @property
    def decode_gemm(self) -> str:
        """What runs the decode-sized GEMMs when it is not `backend`: e.g. 'deep_gemm (M <= 512)'; '' otherwise."""
        if not self._fast or (self._fast.decode is None and self._fast.fused is None):
            return ""
        return f"{self.decode_backend} (M <= {self.decode_max_m})"

    def input_kernel(self, dtype: torch.dtype) -> str | None:
        """What quantizes `dtype` activations on the prepared cuBLASLt path ('cuda:quant_1x128' or 'triton'); None
        off that path (the general path quantizes through `ops.quantize`)."""
        if not self._fast:
            return None
        return activation_quantizer(self._fast.device, self._fast.pow2, dtype)[1]

    def views(self) -> list[QuantizedTensor]:
        out, r, sr = [], 0, 0
        for rows, srows, b0 in self.groups:
            out.append(QuantizedTensor(self.weight[r : r + rows], self.weight_scale[sr : sr + srows], (b0, self.block_cols)))
            r, sr = r + rows, sr + srows
        return out

    # -- derived operands ---------------------------------------------------------------------------
    def refresh(self) -> None:
        """Re-derive what the GEMM reads from the weight after its bytes or scales changed (in place)."""
        if self._fast is None:
            self._fast = _CublasPlan.build(self)
        elif self._fast:
            self._fast.refresh(self)
        if self.native_asked and self._fast and self._fast.decode is None and self._fast.fused is None:
            from .engine_native import native_linear

            # rebuilt on each refresh: it holds the scale tensor the Python path reads now
            self._native = native_linear(self.weight, self._fast.sb, self.input_spec.pow2_scale)

    @property
    def host_call(self) -> str:
        """'native' where decode-sized batches run the one C++ call, else 'python'."""
        return "native" if self._native is not None else "python"

    # -- forward ------------------------------------------------------------------------------------
    def __call__(self, x2: torch.Tensor) -> torch.Tensor:
        native = self._native
        if native is not None:
            y = native(x2, self._fast.stream())
            if y is not None:  # None: a batch it is not for (see `engine_native`)
                return y
        if x2.shape[0] == 0:
            return x2.new_empty((0, self.n))
        if not self.input_spec.is_fp8:
            # W8A16 (not a named recipe): dequantize the weight, GEMM in fp32, round once.
            w = torch.cat([v.dequantize(torch.float32) for v in self.views()])
            return (x2.float() @ w.t()).to(x2.dtype)
        if self._fast:
            return self._fast(x2)
        xq = ops.quantize(x2, self.input_spec)
        if self.one_grid:
            b0 = self.groups[0][2]
            y = gemm_nt(xq, QuantizedTensor(self.weight, self.weight_scale, (b0, self.block_cols)), x2.dtype, self.backend)
        else:
            y = torch.cat([gemm_nt(xq, v, x2.dtype, self.backend) for v in self.views()], dim=-1)
        # Backends may return a slice of a padded result; the op promises a contiguous output.
        return y if y.is_contiguous() else y.contiguous()


class _CublasPlan:
    """The cuBLASLt blockwise call with its weight operands prepared: activation quantized into an
    M-padded buffer (`activation_quantizer`), then one scaled_mm. The same call `torch_gemm_nt` makes
    (same operands, same padded M), so the bytes equal the general path's.

    With a decode backend (DeepGEMM), batches of M <= decode_max_m run its 1x128.128x128 kernel on the same
    quantized activation instead: the same call the `deep_gemm` backend makes, so the bytes equal `gemm_nt`'s
    on that backend."""

    def __init__(self, lin: EngineLinear, mm, decode=None, fused=None) -> None:
        self.mm = mm
        self.pow2 = lin.input_spec.pow2_scale
        self.device = lin.weight.device
        # fn() -> the current stream's handle (with the device, the workspace's key); 0 off CUDA (the host-cost proxy)
        self.device_index = (self.device.index if self.device.index is not None else torch.cuda.current_device()) if self.device.type == "cuda" else -1
        self.stream = functools.partial(torch._C._cuda_getCurrentRawStream, self.device_index) if self.device.type == "cuda" else int
        self._quantizers: dict[torch.dtype, object] = {}  # activation dtype -> fn(x, rows_alloc)
        self.w_t = lin.weight.t()
        self.sb_buf: torch.Tensor | None = None
        self.n = lin.n
        # For M <= decode_max, at most one of: fn(xq, m, mp) -> y on the quantized activation (DeepGEMM or vLLM's
        # CUTLASS kernel, bf16 outputs only), or fn(x2) -> y quantizing inside the GEMM (the one-launch FP8 linear)
        self.decode, self.fused, self.decode_max = decode, fused, lin.decode_max_m
        self.refresh(lin)

    @classmethod
    def build(cls, lin: EngineLinear) -> "_CublasPlan | bool":
        """The plan, or False when this layer takes the general path."""
        if (
            lin.backend != "torch"
            or not lin.one_grid
            or lin.input_spec.granularity is not Granularity.BLOCK_1x128
            or lin.groups[0][2] != 128
            or lin.block_cols != 128
            or lin.k % 128
            or lin.n % 128
            or ops.kernel_name(lin.weight.device) != "triton"
        ):
            return False
        from ..gemm import torch_backend

        decode = fused = None
        if lin.decode_backend == "deep_gemm" and lin.decode_max_m > 0:
            from ..gemm.deep_gemm_backend import _sm90_sfb

            # Only a scale grid DeepGEMM reads in place: weight installs copy into it, and the kernel must see them.
            if _sm90_sfb(lin.weight_scale) is lin.weight_scale:
                decode = _deep_gemm_decode(*_deep_gemm_call(lin.weight.device), lin.weight, lin.weight_scale, lin.n)
        elif lin.decode_backend == "vllm_cutlass" and lin.decode_max_m > 0:
            from . import vllm_cutlass

            fn = vllm_cutlass.decode_gemm(lin.weight.device)
            if fn is not None:
                decode = _cutlass_decode(fn, lin.weight.t(), lin.weight_scale.t(), lin.n)
        elif lin.decode_backend == FUSED_DECODE and lin.decode_max_m > 0:
            fused = _fused_decode(lin.weight, lin.weight_scale, lin.input_spec.pow2_scale)
        elif lin.decode_backend:
            raise ValueError(f"EngineLinear: decode backend {lin.decode_backend!r} is not supported here; use 'deep_gemm', "
                             f"'vllm_cutlass', '{FUSED_DECODE}' or ''")
        return cls(lin, torch_backend.prepared_scaled_mm(lin.weight.device), decode, fused)

    def quantizer(self, dtype: torch.dtype):
        """fn(x, rows_alloc) quantizing `dtype` activations: `activation_quantizer`'s choice, kept per dtype."""
        fn = self._quantizers.get(dtype)
        if fn is None:
            fn, _ = activation_quantizer(self.device, self.pow2, dtype)
            if not _capturing():
                self._quantizers[dtype] = fn
        return fn

    def _quantize(self, x2: torch.Tensor, mp: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(data, scale) of x2 quantized 1x128 with M padded to mp: into the shared workspace where the quantizer
        writes into buffers and the batch is decode-sized (outside graph capture), else freshly allocated."""
        fn = self._quantizers.get(x2.dtype) or self.quantizer(x2.dtype)
        into = getattr(fn, "into", None)
        if into is not None and mp <= _WS_MAX_M and _USE_WS:
            key = (self.device_index, self.stream(), x2.shape[1], mp)
            ws = _ACT_WS.get(key) or _act_workspace(self.device, key)
            if ws is not None and into(x2, *ws):
                return ws
        xq = fn(x2, mp)
        return xq.data, xq.scale

    def refresh(self, lin: EngineLinear) -> None:
        from ..kernels.layout import row_major_padded_t

        sb = row_major_padded_t(lin.weight_scale)
        if sb.data_ptr() == lin.weight_scale.data_ptr():
            self.sb = sb  # a view of the scale parameter: in-place installs update it already
            return
        if self.sb_buf is None:
            self.sb_buf = sb
        else:
            self.sb_buf.copy_(sb)  # same buffer, so a captured graph keeps reading valid scales
        self.sb = self.sb_buf

    def __call__(self, x2: torch.Tensor) -> torch.Tensor:
        m = x2.shape[0]
        if m <= self.decode_max and self.fused is not None and x2.dtype != torch.float32:
            return self.fused(x2)
        mp = -(-m // 4) * 4  # cuBLASLt refuses an MN-major scale_a whose M is not a multiple of 4
        q, s = self._quantize(x2, mp)
        if m <= self.decode_max and self.decode is not None and x2.dtype == torch.bfloat16:
            return self.decode(QuantizedTensor.trusted(q, s, (1, 128)), m, mp)
        y = self.mm(q, self.w_t, s, self.sb, x2.dtype)
        return y if mp == m else y[:m]


def _fused_decode(weight: torch.Tensor, weight_scale: torch.Tensor, pow2: bool):
    """fn(x2) -> y: the FP8 linear in one launch, quantizing x2 inside the GEMM."""
    from ..kernels.quant_gemm import fp8_linear_invariant

    # The weight parameters themselves (row-major 128x128 scales, read in place): in-place weight installs show.
    return lambda x2: fp8_linear_invariant(x2, weight, weight_scale, 128, x2.dtype, pow2)


def _deep_gemm_decode(fn, kw: dict, weight: torch.Tensor, weight_scale: torch.Tensor, n: int):
    w_dg = (weight, weight_scale)  # DeepGEMM reads the row-major (N/128, K/128) scale parameter itself

    def decode(xq, m: int, mp: int) -> torch.Tensor:
        # The first m rows, scales still strided by mp: the TMA-aligned MN-major layout DeepGEMM reads as is.
        y = torch.empty((m, n), dtype=torch.bfloat16, device=xq.data.device)
        fn((xq.data[:m], xq.scale[:m]), w_dg, y, **kw)
        return y

    return decode


def _cutlass_decode(fn, w_t: torch.Tensor, w_scale_t: torch.Tensor, n: int):
    # Views of the weight parameters (W^T column-major, its scales transposed): in-place weight installs show.

    def decode(xq, m: int, mp: int) -> torch.Tensor:
        y = torch.empty((mp, n), dtype=torch.bfloat16, device=xq.data.device)
        fn(y, xq.data, xq.scale, w_t, w_scale_t)
        return y if mp == m else y[:m]  # leading rows of a contiguous buffer: contiguous

    return decode


@functools.lru_cache(maxsize=None)
def _deep_gemm_call(device: torch.device) -> tuple:
    """(fp8_gemm_nt, its keywords) of the deep_gemm backend on `device`, resolved once: the compiled engine's custom
    op rebuilds its plan on every call it makes outside a captured graph (prefill batches)."""
    from ..gemm.deep_gemm_backend import DeepGemmPreparedGemm

    dg = DeepGemmPreparedGemm(device)
    return dg.fn, dg.kw


_ACT_QUANTIZERS: dict[tuple, tuple] = {}


# Eager decode-sized batches quantize their activation into a workspace shared by every layer of one K on one
# stream (`_act_workspace`), saving the quantizer's two allocations per call. Safe because the stream orders each
# layer's GEMM (the reader) before the next layer's quantization (the writer); up to _WS_MAX_M rows, so a workspace
# is at most _WS_MAX_M x K bytes (plus scales). Not while a CUDA graph is captured: replays pay no host time, and a
# captured engine keeps the allocations it was validated with. JETRL_ENGINE_WORKSPACE=0 allocates per call (A/B).
_WS_MAX_M = 512
_USE_WS = os.environ.get("JETRL_ENGINE_WORKSPACE", "1") != "0"
# (device index, stream, K, mp) -> (data, scale) views; (device index, stream, K) -> the flat buffers
_ACT_WS: dict[tuple[int, int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
_ACT_WS_FLAT: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _act_workspace(device: torch.device, key: tuple[int, int, int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Views of the (device, stream, K) workspace for mp rows: data [mp, K] contiguous, scale [mp, ceil(K/128)]
    MN-major (strides (1, mp), the layout cuBLASLt reads: the first mp x G floats of the flat buffer). None while
    the stream captures a graph."""
    if _capturing():
        return None
    hit = _ACT_WS.get(key)
    if hit is None:
        k, mp = key[2], key[3]
        g = -(-k // 128)
        flat = _ACT_WS_FLAT.get(key[:3])
        if flat is None:
            flat = _ACT_WS_FLAT[key[:3]] = (torch.empty(_WS_MAX_M * k, dtype=torch.float8_e4m3fn, device=device),
                                            torch.empty(_WS_MAX_M * g, dtype=torch.float32, device=device))
        hit = _ACT_WS[key] = (flat[0][: mp * k].view(mp, k), torch.as_strided(flat[1], (mp, g), (1, mp)))
    return hit


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (never, where this torch has no CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def activation_quantizer(device: torch.device, pow2: bool, dtype: torch.dtype) -> tuple:
    """(fn(x, rows_alloc), kernel name) quantizing an engine's `dtype` activations 1x128 on `device`: the CUDA kernel
    with the lean launch where it compiled and wrote the reference's bytes at first use (`quant_cuda`), else the
    Triton kernel (same bytes; `quant_cuda` logged why). JETRL_CUDA_QUANT=0 keeps the Triton kernel (an A/B switch).

    The first-use check synchronizes the device, so while a CUDA graph is being captured an unchecked choice is not
    made: that call gets the Triton kernel (vLLM's profiling forward runs eagerly before any capture, so in practice
    the check has run by then)."""
    key = (device, pow2, dtype)
    hit = _ACT_QUANTIZERS.get(key)
    if hit is not None:
        return hit
    from ..kernels import quant, quant_cuda

    if os.environ.get("JETRL_CUDA_QUANT", "1") != "0" and not _capturing():
        fn = quant_cuda.quantizer_1x128(device, pow2, dtype)
        if fn is not None:
            hit = _ACT_QUANTIZERS[key] = (fn, quant_cuda.GRAPH_KERNEL)
            return hit
    triton_q = quant.quantize_1x128

    def triton_fn(x: torch.Tensor, rows_alloc: int | None = None):
        return triton_q(x, pow2, rows_alloc=rows_alloc)

    hit = (triton_fn, "triton")
    if not _capturing():
        _ACT_QUANTIZERS[key] = hit
    return hit
