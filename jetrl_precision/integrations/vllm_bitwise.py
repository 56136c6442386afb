"""The vLLM side of the bitwise mode: an engine whose every logit and log-prob is the trainer's, bit for bit.

A `jetrl_fp8` engine whose settings say `bitwise=True` (`vllm_plugin.engine_kwargs(..., bitwise=True)`) runs the
trainer's batch-invariant numerics (`jetrl_precision.batch_invariant`, CUDA):
- RMSNorm (with vLLM's fused residual add), rotary (default and llama3 rope) and SiLU*mul: vLLM's classes are replaced
  process-wide through its out-of-tree CustomOp registry (looked up by class name when a layer is built). The
  replacements decide at construction, from the vLLM config being built, whether the engine is bitwise; if not they
  are vLLM's classes unchanged (same dispatch, same registry name). In a bitwise engine their forwards call the opaque
  ops of `batch_invariant.engine_ops`, which compute what the converted transformers model computes;
- high-precision linears (all of them under bf16) and lm_head: `InvariantLinearMethod` / `InvariantEmbeddingMethod`
  (the invariant Triton GEMM; the embedding lookup is vLLM's), returned by `JetFp8Config.get_quant_method`;
- FP8 linears: the `triton_invariant` GEMM backend (`JetFp8Settings` refuses any other);
- attention: the backend of `vllm_bitwise_attention` (`bitwise_attention_engine_kwargs()` selects it);
- log-probs: the sampler's (V1 or V2 model runner) become `kernels.invariant_softmax.log_softmax(logits, T)`, the
  kernel and temperature division of the trainer's `invariant_log_probs` (`install_bitwise_sampler`).
Imported only by plugin and worker code: it imports vLLM.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.model_executor.custom_op import CustomOp, op_registry_oot
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.llama3_rope import Llama3RotaryEmbedding
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from ..batch_invariant import engine_ops
from ..batch_invariant.common import BitwiseUnavailable
from ..gemm.vendor_route import route_state
from .vllm_plugin import JetFp8Settings

__all__ = [
    "BitwiseRMSNorm",
    "BitwiseRotaryEmbedding",
    "BitwiseLlama3RotaryEmbedding",
    "BitwiseSiluAndMul",
    "InvariantLinearMethod",
    "InvariantEmbeddingMethod",
    "OOT_LAYERS",
    "register_oot_layers",
    "building_bitwise_engine",
    "install_bitwise_sampler",
    "set_bitwise_temperature",
    "engine_numerics",
    "INVARIANT_DETAIL",
]

logger = logging.getLogger(__name__)

_OPS = getattr(torch.ops, engine_ops.OPS)
_GEMM_DTYPES = (torch.bfloat16, torch.float16)


def _current_vllm_config():
    from vllm.config import get_current_vllm_config_or_none

    return get_current_vllm_config_or_none()


def building_bitwise_engine() -> bool:
    """Whether the vLLM config being built (the one layers see at construction) is a bitwise `jetrl_fp8` engine."""
    settings = getattr(getattr(_current_vllm_config(), "quant_config", None), "settings", None)
    return isinstance(settings, JetFp8Settings) and settings.bitwise


# ---- layers (out-of-tree CustomOps) -----------------------------------------------------------------
class BitwiseRMSNorm(RMSNorm):
    """vLLM's RMSNorm; in a bitwise engine `InvariantRMSNorm`'s kernel after transformers' residual add."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.jetrl_bitwise = building_bitwise_engine()
        if self.jetrl_bitwise:
            if getattr(self, "variance_size_override", None) is not None or not getattr(self, "has_weight", True):
                raise BitwiseUnavailable("bitwise vLLM engine: an RMSNorm with a variance size override or no weight has no invariant kernel")
            self._forward_method = self._forward_bitwise

    def _forward_bitwise(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return _OPS.rms_norm(x, self.weight, self.variance_epsilon)
        y, r = _OPS.add_rms_norm(x, residual, self.weight, self.variance_epsilon)
        return y, r


class _BitwiseRotary:
    """What the bitwise rotary classes share: transformers' inverse frequencies for the model, and the op."""

    def _setup_bitwise(self) -> None:
        self.jetrl_bitwise = building_bitwise_engine()
        if not self.jetrl_bitwise:
            return
        if not self.is_neox_style or self.rotary_dim != self.head_size:
            raise BitwiseUnavailable(
                f"bitwise vLLM engine: rotary with is_neox_style={self.is_neox_style}, rotary_dim={self.rotary_dim} of "
                f"head_size={self.head_size}; the invariant rotary is transformers' Llama one (neox style, whole head)"
            )
        hf_config = _current_vllm_config().model_config.hf_text_config
        inv_freq, scaling = engine_ops.hf_rope_inv_freq(hf_config)
        if 2 * inv_freq.numel() != self.head_size:
            raise BitwiseUnavailable(
                f"bitwise vLLM engine: transformers gives {inv_freq.numel()} rotary frequencies for head_size {self.head_size}"
            )
        # cos | sin of every position, once, in the model dtype: the decode step then gathers rows instead of
        # recomputing them in every layer
        dtype = _current_vllm_config().model_config.dtype
        table = engine_ops.rope_table(inv_freq.to(torch.get_default_device()), scaling, self.max_position_embeddings, dtype)
        self.register_buffer("jetrl_rope_table", table, persistent=False)
        self._forward_method = self._forward_bitwise

    def _forward_bitwise(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None):
        if key is None:
            raise BitwiseUnavailable("bitwise vLLM engine: rotary without a key (cross-layer KV sharing) is not supported")
        q, k = _OPS.rotary(positions.flatten(), query, key, self.jetrl_rope_table, self.head_size)
        return q, k


class BitwiseRotaryEmbedding(_BitwiseRotary, RotaryEmbedding):
    """vLLM's default rotary; in a bitwise engine transformers' `apply_rotary_pos_emb` with its cos/sin."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._setup_bitwise()


class BitwiseLlama3RotaryEmbedding(_BitwiseRotary, Llama3RotaryEmbedding):
    """vLLM's llama3-scaled rotary; in a bitwise engine transformers' (its llama3 inverse frequencies)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._setup_bitwise()


class BitwiseSiluAndMul(SiluAndMul):
    """vLLM's SiluAndMul; in a bitwise engine transformers' `act_fn(gate) * up` in eager torch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.jetrl_bitwise = building_bitwise_engine()
        if self.jetrl_bitwise:
            self._forward_method = _OPS.silu_and_mul


# vLLM looks an out-of-tree replacement up by the name of the class being built (CustomOp.__new__).
OOT_LAYERS: dict[str, type] = {
    "RMSNorm": BitwiseRMSNorm,
    "RotaryEmbedding": BitwiseRotaryEmbedding,
    "Llama3RotaryEmbedding": BitwiseLlama3RotaryEmbedding,
    "SiluAndMul": BitwiseSiluAndMul,
}


def register_oot_layers() -> bool:
    """Install the replacement classes in vLLM's out-of-tree registry (process-wide, inert outside bitwise engines).
    Idempotent. Returns False, with a warning, when another plugin already replaced one of these classes."""
    ok = True
    for name, cls in OOT_LAYERS.items():
        current = op_registry_oot.get(name)
        if current is cls:
            continue
        if current is not None:
            logger.warning("jetrl_fp8: %s is already replaced by %s; bitwise engines cannot use it", name, current.__qualname__)
            ok = False
            continue
        parent_name = cls.name  # the in-tree registry name ("rms_norm", ...): custom_ops flags keep addressing it
        CustomOp.register_oot(cls, name=name)
        cls.name = parent_name
    return ok


# ---- high-precision GEMMs ---------------------------------------------------------------------------
def _check_gemm_dtype(layer: torch.nn.Module, what: str) -> None:
    dtype = layer.weight.dtype
    if dtype not in _GEMM_DTYPES:
        raise BitwiseUnavailable(f"bitwise vLLM engine: {what} weights are {dtype}; the invariant GEMM multiplies bf16/fp16 (--vllm.dtype bfloat16)")


class InvariantLinearMethod(UnquantizedLinearMethod):
    """An unquantized linear whose forward is `InvariantLinear`'s GEMM (`kernels.invariant_gemm.linear_invariant`)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        _check_gemm_dtype(layer, type(layer).__name__)  # and no vendor repacking: the GEMM reads the [N, K] weight

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _OPS.linear(x, layer.weight, bias)


class InvariantEmbeddingMethod(UnquantizedEmbeddingMethod):
    """vLLM's embedding lookup; as lm_head (`apply`, tied or not) the invariant GEMM over the (padded) vocabulary."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        _check_gemm_dtype(layer, "embedding/lm_head")

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _OPS.linear(x, layer.weight, bias)


# ---- log-probs (runs in the worker) ------------------------------------------------------------------
def _sampler_runner(sampler: Any) -> str | None:
    """"v1" for the V1 model runner's sampler, "v2" for the V2 runner's (vLLM picks the runner per engine), else None."""
    from vllm.v1.sample.sampler import Sampler

    if isinstance(sampler, Sampler):
        return "v1"
    try:
        from vllm.v1.worker.gpu.sample.sampler import Sampler as V2Sampler
    except ImportError:  # a vLLM without the V2 model runner
        return None
    return "v2" if isinstance(sampler, V2Sampler) else None


def install_bitwise_sampler(worker: Any) -> str:
    """Make the worker's sampler return log-probs from the trainer's kernel: `log_softmax(logits, T)` of
    `kernels.invariant_softmax` (fp32, one fixed order per row, IEEE division by T), the function
    `invariant_log_probs` evaluates at the sampled token. Returns "<class>/<runner>".

    V1 runner: the sampler's `compute_logprobs` is replaced on the instance. V2 runner: its log-probs come from the
    module function `sample.logprob.compute_token_logprobs` (a fused Triton log-softmax at the requested ids), which
    is replaced in this worker process; an engine owns its process, so no other engine sees it."""
    sampler = getattr(getattr(worker, "model_runner", None), "sampler", None)
    runner = _sampler_runner(sampler)
    if runner is None:
        raise BitwiseUnavailable(
            f"bitwise vLLM engine: the worker's sampler is {type(sampler).__name__}, not vLLM's V1 or V2 (model runner) "
            "sampler whose log-probs it replaces; start the engine with VLLM_USE_V2_MODEL_RUNNER=0"
        )
    if sampler.logprobs_mode != "raw_logprobs":
        raise BitwiseUnavailable(f"bitwise vLLM engine: logprobs_mode {sampler.logprobs_mode!r}; the trainer's log-probs are raw_logprobs")
    from ..kernels import triton_available

    if not triton_available():
        raise BitwiseUnavailable("bitwise vLLM engine: its log-probs come from a Triton kernel and Triton is not installed")
    sampler.jetrl_temperature = 1.0

    def log_probs(logits: torch.Tensor) -> torch.Tensor:
        from ..kernels.invariant_softmax import log_softmax  # imported at first use: the module compiles Triton jits

        return log_softmax(logits, sampler.jetrl_temperature)

    if runner == "v1":
        sampler.compute_logprobs = log_probs
    else:
        from vllm.v1.worker.gpu.sample import logprob

        def compute_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
            # the raw logits (the sampler processes a copy); the full row's log-softmax, then the ids' entries
            return log_probs(logits).gather(-1, token_ids.to(torch.int64))

        logprob.compute_token_logprobs = compute_token_logprobs
    return f"{type(sampler).__qualname__}/{runner}"


def set_bitwise_temperature(worker: Any, temperature: float) -> None:
    """The temperature the bitwise log-probs divide by (the one the sampler samples at)."""
    sampler = worker.model_runner.sampler
    if not hasattr(sampler, "jetrl_temperature"):
        raise RuntimeError("bitwise vLLM engine: install_bitwise_sampler has not run in this worker")
    sampler.jetrl_temperature = float(temperature)


# ---- what a loaded engine runs (the precision graph's numerics) --------------------------------------------------
INVARIANT_DETAIL = "attention=bitwise_paged linear=triton_invariant fp8_gemm={fp8} norm=triton rotary=invariant " \
                   "silu_mul=invariant logprobs=invariant_softmax"


def _attention_not_bitwise(model: torch.nn.Module) -> str | None:
    """Why the model's attention layers are not all the bitwise backend, or None."""
    try:
        from .vllm_bitwise_attention import check_bitwise_attention
    except ImportError as e:  # the backend subclasses vLLM's Triton one: absent without Triton
        return f"attention: the bitwise backend cannot be imported ({e})"
    try:
        check_bitwise_attention(model)
    except RuntimeError as e:
        return str(e)
    return None


def engine_numerics(worker: Any, model: torch.nn.Module) -> tuple[str, str]:
    """The numerics a loaded bitwise engine runs, read from the modules it instantiated (not from its settings):
    ("batch_invariant", detail) when every op that feeds a quantizer or the logits is the trainer's invariant one,
    else ("ordinary", what is not, one item per kind). The precision check compares this with the trainer's
    `numerics_of`, so an engine that silently built a vLLM op somewhere is refused before any rollout."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    from .vllm_plugin import jetrl_method_of

    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    bad: list[str] = []

    def first_of(what: str, names: list[str]) -> None:
        if names:
            bad.append(f"{len(names)} {what} (e.g. {names[0]})")

    leaves = [(n, m) for n, m in model.named_modules() if not any(True for _ in m.children())]
    first_of("vLLM norm(s)", [n for n, m in leaves if "norm" in type(m).__name__.lower() and not getattr(m, "jetrl_bitwise", False)])
    first_of("vLLM rotary embedding(s)", [n for n, m in model.named_modules()
                                          if hasattr(m, "rotary_dim") and hasattr(m, "is_neox_style") and not getattr(m, "jetrl_bitwise", False)])
    first_of("vLLM activation(s)", [n for n, m in leaves if (isinstance(m, SiluAndMul) or type(m).__module__.startswith("vllm.model_executor.layers.activation"))
                                    and not getattr(m, "jetrl_bitwise", False)])
    fp8, plain = [], []
    for n, m in model.named_modules():
        if not isinstance(m, (LinearBase, ParallelLMHead)):
            continue
        quant = getattr(m, "quant_method", None)
        method = jetrl_method_of(m)
        if method is not None:
            backend = method.backend_for(device)
            if backend == "triton_invariant":
                fp8.append(n)
            else:
                plain.append(f"{n}: FP8 GEMM {backend}")
        elif not isinstance(quant, InvariantLinearMethod if isinstance(m, LinearBase) else InvariantEmbeddingMethod):
            plain.append(f"{n}: {type(quant).__name__}")
    first_of("linear(s) outside the invariant GEMMs", plain)
    # Anything else holding a weight matrix (FusedMoE's expert tensors, a model's own head) multiplies on vLLM's
    # kernels, whose tiling follows the batch: the trainer's numerics_of refuses the same modules.
    first_of("module(s) with matrix products of their own (MoE experts?)",
             [f"{n}: {type(m).__name__}" for n, m in model.named_modules()
              if not isinstance(m, (LinearBase, VocabParallelEmbedding)) and any(p.dim() >= 2 for p in m.parameters(recurse=False))])
    attention = _attention_not_bitwise(model)
    if attention:
        bad.append(attention)
    sampler = getattr(getattr(worker, "model_runner", None), "sampler", None)
    if not hasattr(sampler, "jetrl_temperature"):
        bad.append(f"log-probs from {type(sampler).__name__} (install_bitwise_sampler has not run)")
    if bad:
        return "ordinary", "bitwise engine with vLLM ops left: " + "; ".join(bad)
    route = route_state(device)  # recorded as the trainer's numerics_of records it
    detail = INVARIANT_DETAIL.format(fp8="triton_invariant" if fp8 else "-")
    return "batch_invariant", detail + (f" vendor_route={route}" if route != "-" else "")
