"""Shared helpers for the CPU jetrl_precision tests: seeding, data with outliers, SQNR, tiny models,
and worst-case rounding-error bounds for comparisons against float64 references.

Import them as `from precision_testutil import ...` (a unique module name: `conftest` is
ambiguous once tests/gpu/ has its own). tests/conftest.py exposes them as fixtures too.
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch


def seed_everything(seed: int = 0) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def outlier_data(
    shape: tuple[int, ...],
    *,
    group: int = 128,
    spikes: int = 4,
    spike_factor: float = 1000.0,
    sigma: float = 1.5,
    dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Gaussian data whose magnitude varies like real LLM activations.

    Every run of `group` consecutive elements along the last dim gets a log-normal factor
    (exp(N(0, sigma))), so groups differ by orders of magnitude, and `spikes` random
    elements are multiplied by `spike_factor` (the outlier channels that make per-tensor
    scaling fail). Never all zeros.
    """
    g = generator
    x = torch.randn(*shape, generator=g)
    last = shape[-1]
    n_groups = -(-last // group)
    factors = torch.exp(sigma * torch.randn(*shape[:-1], n_groups, generator=g))
    x = x * factors.repeat_interleave(group, dim=-1)[..., :last]
    if spikes:
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (spikes,), generator=g)
        flat[idx] *= spike_factor
    return x.to(dtype)


def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `test` against `ref`, in dB (computed in float64)."""
    ref64, test64 = ref.detach().double(), test.detach().double()
    noise = (ref64 - test64).pow(2).sum()
    signal = ref64.pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10.0 * torch.log10(signal / noise))


# ---- tiny transformers models, built from configs (no model hub) ---------------------------------
def tiny_causal_lm(
    arch: str = "llama",
    *,
    hidden: int = 256,
    intermediate: int = 512,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int | None = 2,
    vocab: int = 512,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A randomly initialised LlamaForCausalLM / Qwen2ForCausalLM small enough for CPU tests."""
    import transformers

    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    cfg = cfg_cls(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return model_cls(cfg).to(dtype)


def prefill_then_decode(model, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, prompt: int) -> torch.Tensor:
    """The logits [B, T, V] of `ids` as generation computes them: one prefill of the first `prompt` tokens into a
    transformers DynamicCache, then one token per step against the cache. A batch-invariant model gives its full
    forward's bits here (`mask` and `pos` are the full forward's, left padding included)."""
    import transformers

    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        first = model(input_ids=ids[:, :prompt], attention_mask=mask[:, :prompt], position_ids=pos[:, :prompt],
                      past_key_values=cache, use_cache=True).logits
        steps = [model(input_ids=ids[:, t : t + 1], attention_mask=mask[:, : t + 1], position_ids=pos[:, t : t + 1],
                       past_key_values=cache, use_cache=True).logits[:, 0] for t in range(prompt, ids.shape[1])]
    return torch.cat([first, torch.stack(steps, 1)], 1)


# ---- rounding-error bounds (docs/testing.md says which test uses which) ----------------------------------
# Every bound holds for ANY summation order (SIMD width, blocking, threads, FMA or not), so a test
# that uses one passes on any x86 CPU/BLAS; it is derived from K, the dtype and the operations,
# never tuned on a machine. References are float64; u is the unit roundoff of the compared dtype.

# Elementwise exp/log in torch CPU builds (SLEEF u10 vector code, glibc/MKL scalar tails) are within
# 1 ulp; 4 leaves room for any libm a build links. One ulp of y is at most 2u|y|.
LIBM_ULPS = 4
_UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    return _UNIT_ROUNDOFF[dtype]


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """gamma_n = n u / (1 - n u): the relative error bound of n chained roundings (Higham, Lemma 3.1)."""
    nu = max(n, 0) * unit_roundoff(dtype)
    if nu >= 0.5:
        raise ValueError(f"gamma({n}) in {dtype} is not a useful bound (n u = {nu})")
    return nu / (1 - nu)


def libm_error(y: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Bound on the error of one elementwise transcendental call returning y (LIBM_ULPS ulps)."""
    return 2 * LIBM_ULPS * unit_roundoff(dtype) * y.double().abs()


def matmul_bound(a: torch.Tensor, b: torch.Tensor, extra: torch.Tensor | float = 0.0, *, roundings: int = 0,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """|fl(a @ b + extra) - (a @ b + extra)| <= gamma_{K + roundings} (|a| @ |b| + |extra|), elementwise.

    Higham, Accuracy and Stability, eq. (3.13): any order of the K-term sum; `roundings` adds
    the other roundings on the path (the fp32 dequantization of each operand, the bias add).
    """
    a64, b64 = a.double(), b.double()
    extra64 = extra.double().abs() if isinstance(extra, torch.Tensor) else abs(extra)
    return gamma(a.shape[-1] + roundings, dtype) * (a64.abs() @ b64.abs() + extra64) + 1e-300


def sum_bound(terms: torch.Tensor, dim: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """|fl(sum) - sum| <= gamma_{n-1} sum |x_i| for any order of the n-term sum."""
    t = terms.double().abs()
    n = t.numel() if dim is None else t.shape[dim]
    return gamma(n - 1, dtype) * (t.sum() if dim is None else t.sum(dim))


def log_softmax_bound(z: torch.Tensor, *, divided: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Bound on |fl(z_j - logsumexp(z)) - (z_j - logsumexp(z))| over the last dim, for every j.

    `z` holds the exact (float64) arguments; `divided` when fp32 formed them as x / T (one
    rounding each). With M = max|z|, n = len, r the exact result, e = 2 LIBM_ULPS u (one libm call):
      input rounding         |dz_i| <= uM  ->  |d result| <= 2uM (log-softmax is 2-Lipschitz in max-norm)
      z_i - m                rounding <= 2uM (1 + u), an argument error of exp: relative 2uM
      exp, sum of n >= 1     relative e, then gamma_{n-1}: log S is off by delta / (1 - delta)
      log S (0 <= log S <= log n) e log n;  m + log S: u (M + log n);  z_j - lse: u |r|
    """
    u = unit_roundoff(dtype)
    z = z.double()
    n = z.shape[-1]
    big_m = z.abs().amax(-1, keepdim=True)
    r = torch.log_softmax(z, -1)
    e = 2 * LIBM_ULPS * u
    delta = 2 * u * big_m * (1 + u) + e + gamma(n - 1, dtype)
    bound = (
        (2 * u * big_m if divided else 0.0)
        + delta / (1 - delta)
        + e * math.log(n)
        + u * (big_m + math.log(n))
        + u * r.abs()
    )
    return bound * (1 + 1e-6) + 1e-300


def assert_within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor | float, what: str = "") -> None:
    """Every |got - ref| <= bound (elementwise), or an error naming the count, the worst excess and where."""
    err = (got.double() - ref.double()).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(err)
    bad = ~(err <= bound)
    if bad.any():
        excess = torch.where(bad, err - bound, torch.full_like(err, -math.inf))
        i = int(excess.reshape(-1).argmax())
        idx = tuple(int(v) for v in np.unravel_index(i, tuple(err.shape))) if err.dim() else ()
        raise AssertionError(
            f"{what or 'values'}: {int(bad.sum())} of {err.numel()} outside the bound; worst at {idx}: "
            f"|{got.reshape(-1)[i].item()!r} - {ref.reshape(-1)[i].item()!r}| = {err.reshape(-1)[i].item():.3e} > bound {bound.reshape(-1)[i].item():.3e}"
        )


# ---- batch-invariant kernels: exact bits, and the attention bound ---------------------------------------------------
def float_bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (torch.equal would call -0.0 and +0.0 equal)."""
    return t.contiguous().view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Kind 1 (exact): the same shape, dtype and bits."""
    assert a.shape == b.shape and a.dtype == b.dtype, what
    diff = float_bits(a) != float_bits(b)
    assert not diff.any(), f"{what}: {int(diff.sum())} of {diff.numel()} values differ in their bits"



def _gamma_u(n, u):
    return n * u / (1 - n * u)  # gamma_n for a unit roundoff u (tensors or floats)


def attention_bound(q, k, v, scale, *, key_block: int, u_acc: float = 2.0**-24, drop_diagonal: bool = False):
    """The float64 causal attention of one sequence ([L, H, D] / [L, Hkv, D]) and a worst-case bound on the kernel.

    Let a_j = (q . k_j) scale log2(e), the exact exponent, out = sum_j w_j v_j with w = softmax. The kernel forms
    t_j = fl(fl(q . k_j) c): |t_j - a_j| <= delta_j = (gamma_D(u_acc) sum|q k_j| c + 2u|a_j|)(1 + 4u) (c itself
    rounded to fp32). Every exponent argument it forms (t_j - m, and m_old - m_new for each rescaling) is then
    rounded once more, by at most u 2A with A = max |a| + max delta; exp2 is within e = 2 LIBM_ULPS u. So each
    weight it uses is w_j (1 + eps_j), |eps_j| <= eta = exp(ln2 (delta + 2uA (1 + nb))) (1 + e)^(nb + 1)
    (1 + u)^nb (1 + u_p) - 1 for nb key blocks (the rescalings, their products, p rounded to u_p for p @ v). With
    the numerator and denominator sums (gamma_{K + 2nb}(u_acc)), |N / L - out| <= (2 eta + gamma (1 + eta))
    sum_j w_j |v_j| / (1 - eta); then the division (u) and the rounding to the output dtype. A weight below
    fp32's normal range, flushed or underflowed to zero, moves the output by less than 2^-126 K max|v|: far below
    these terms, except where the output itself is about zero, so that term is added.
    `drop_diagonal` returns the reference of a wrong mask (each query blind to its own key), to show the bound
    catches it."""
    length, heads, dim = q.shape
    groups = heads // k.shape[1]
    u = 2.0**-24
    u_out = unit_roundoff(q.dtype)
    q64, k64, v64 = q.double(), k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    c = scale * math.log2(math.e)
    a = torch.einsum("ihd,jhd->hij", q64, k64) * c
    dev = q.device
    visible = torch.ones(length, length, dtype=torch.bool, device=dev).tril()
    if drop_diagonal:
        visible &= ~torch.eye(length, dtype=torch.bool, device=dev)
        visible[0, 0] = True
    w = torch.softmax((a / math.log2(math.e)).masked_fill(~visible, -math.inf), -1)
    out = torch.einsum("hij,jhd->ihd", w, v64)
    if drop_diagonal:
        return out, None
    delta = (_gamma_u(dim, u_acc) * torch.einsum("ihd,jhd->hij", q64.abs(), k64.abs()) * c + 2 * u * a.abs()) * (1 + 4 * u)
    delta = delta.masked_fill(~visible, 0)
    big_a = (a.abs() + delta).masked_fill(~visible, 0).amax(-1) + delta.amax(-1)  # [h, i]
    n_keys = torch.arange(1, length + 1, dtype=torch.float64, device=dev)
    nb = torch.div(n_keys - 1, key_block, rounding_mode="floor") + 1
    e = 2 * LIBM_ULPS * u
    u_p = unit_roundoff(q.dtype) if q.dtype != torch.float32 else 0.0
    arg = delta.amax(-1) + 2 * u * big_a * (1 + nb)
    eta = torch.exp(math.log(2) * arg) * (1 + e) ** (nb + 1) * (1 + u) ** nb * (1 + u_p) - 1  # [h, i]
    g_n = _gamma_u(n_keys + 2 * nb, u_acc)
    vbar = torch.einsum("hij,jhd->ihd", w, v64.abs())
    eta_t, g_t = eta.t()[:, :, None], g_n[:, None, None]
    b1 = (2 * eta_t + g_t * (1 + eta_t)) * vbar / (1 - eta_t)
    b2 = b1 + u * (out.abs() + b1)
    bound = b2 + u_out * (out.abs() + b2) + 2.0**-126 * n_keys[:, None, None] * v64.abs().amax()
    return out, bound * (1 + 1e-9) + 1e-300
