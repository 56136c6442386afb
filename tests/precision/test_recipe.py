"""Declarative recipes: named recipes, YAML/JSON round trips, overrides and validation errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from jetrl_precision import (
    RECIPE_NAMES,
    BackwardSpec,
    FpropSpec,
    Granularity,
    PrecisionRecipe,
    RecipeError,
    TensorSpec,
    get_recipe,
)
from jetrl_precision.recipe import DType, ScaleRule

E4M3_1x128 = TensorSpec("e4m3", "1x128", "amax/448")
E4M3_128x128 = TensorSpec("e4m3", "128x128", "amax/448")
E4M3_128x1 = TensorSpec("e4m3", "128x1", "amax/448")
BF16 = TensorSpec()


def test_named_recipes_are_the_three_in_design():
    assert set(RECIPE_NAMES) == {"bf16", "fp8_rollout", "jet_fp8"}
    for name in RECIPE_NAMES:
        r = get_recipe(name)
        assert isinstance(r, PrecisionRecipe) and r.name == name
        with pytest.raises(dataclasses.FrozenInstanceError):
            r.name = "other"  # type: ignore[misc]


def test_jet_fp8_matches_the_design_table():
    r = get_recipe("jet_fp8")
    assert r.train_fprop == FpropSpec(input=E4M3_1x128, weight=E4M3_128x128)
    assert r.rollout == r.train_fprop
    bw = r.train_backward
    assert bw.dgrad_grad_output == E4M3_1x128
    assert bw.wgrad_grad_output == E4M3_128x1
    assert bw.wgrad_input == E4M3_128x1
    assert bw.saved_input == E4M3_1x128
    assert bw.grad_dtype == DType.BF16
    for pattern in ("*lm_head*", "*embed*", "*norm*", "*router*"):
        assert pattern in r.keep_high_precision


def test_fp8_rollout_and_bf16():
    fr = get_recipe("fp8_rollout")
    assert not fr.train_fprop.is_fp8 and not fr.train_backward.is_fp8
    assert fr.rollout == get_recipe("jet_fp8").rollout
    b = get_recipe("bf16")
    assert not b.train_fprop.is_fp8 and not b.rollout.is_fp8 and not b.train_backward.is_fp8


def test_unified_and_off_policy_properties():
    assert get_recipe("jet_fp8").unified and not get_recipe("jet_fp8").off_policy
    assert get_recipe("bf16").unified and not get_recipe("bf16").off_policy
    assert get_recipe("fp8_rollout").off_policy and not get_recipe("fp8_rollout").unified
    assert get_recipe("jet_fp8").fp8_anywhere and get_recipe("fp8_rollout").fp8_anywhere
    assert not get_recipe("bf16").fp8_anywhere
    # A jet_fp8 whose rollout uses pow2 scales is no longer unified.
    pow2 = TensorSpec("e4m3", "128x128", "amax/448,pow2up")
    r = get_recipe("jet_fp8").replace(rollout=FpropSpec(E4M3_1x128, pow2))
    assert r.off_policy
    assert "OFF-POLICY" in r.summary() and "unified" in get_recipe("jet_fp8").summary()


def test_quantizer_id_distinguishes_every_numeric_choice():
    ids = {
        E4M3_1x128.quantizer_id,
        E4M3_128x128.quantizer_id,
        E4M3_128x1.quantizer_id,
        TensorSpec("e4m3", "128x128", "amax/448,pow2up").quantizer_id,
        BF16.quantizer_id,
        TensorSpec("fp32").quantizer_id,
    }
    assert len(ids) == 6
    assert TensorSpec("e4m3", "1x128", "amax/448,pow2up").pow2_scale and not E4M3_1x128.pow2_scale


@pytest.mark.parametrize("name", ["bf16", "fp8_rollout", "jet_fp8"])
def test_yaml_and_json_round_trip(name, tmp_path):
    r = get_recipe(name)
    assert PrecisionRecipe.from_yaml(r.to_yaml()) == r
    assert PrecisionRecipe.from_json(r.to_json()) == r
    assert PrecisionRecipe.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    # Serialized form is plain data (strings, lists, dicts), readable by any YAML loader.
    assert yaml.safe_load(r.to_yaml()) == r.to_dict()
    # Files, through both from_* and get_recipe(path).
    (tmp_path / f"{name}.yaml").write_text(r.to_yaml())
    (tmp_path / f"{name}.json").write_text(r.to_json())
    assert PrecisionRecipe.from_yaml(tmp_path / f"{name}.yaml") == r
    assert PrecisionRecipe.from_json(str(tmp_path / f"{name}.json")) == r
    assert get_recipe(str(tmp_path / f"{name}.yaml")) == r
    assert get_recipe(str(tmp_path / f"{name}.json")) == r


def test_yaml_base_with_override(tmp_path):
    text = """
base: jet_fp8
name: jet_fp8_pow2
gemm_backend: emulated
train_fprop:
  weight: {dtype: e4m3, granularity: 128x128, scale_rule: "amax/448,pow2up"}
rollout:
  weight: {dtype: e4m3, granularity: 128x128, scale_rule: "amax/448,pow2up"}
keep_high_precision: ["*lm_head*", "*embed*", "*norm*", "*layers.0.*"]
"""
    path = tmp_path / "custom.yaml"
    path.write_text(text)
    r = get_recipe(str(path))
    base = get_recipe("jet_fp8")
    assert r.name == "jet_fp8_pow2" and r.gemm_backend == "emulated"
    assert r.train_fprop.weight.scale_rule == ScaleRule.AMAX_DIV_POW2 and r.train_fprop.weight.pow2_scale
    # Untouched nested fields come from the base (deep merge, not replace).
    assert r.train_fprop.input == base.train_fprop.input
    assert r.train_backward == base.train_backward
    assert r.unified
    assert r.keep_high_precision == ("*lm_head*", "*embed*", "*norm*", "*layers.0.*")
    # The loaded recipe round-trips on its own (no base needed any more).
    assert PrecisionRecipe.from_yaml(r.to_yaml()) == r


@pytest.mark.parametrize(
    "data, match",
    [
        ({"name": "x", "foo": 1}, r"unknown key.*foo"),
        ({"base": "jet_fp8", "train_fprop": {"input": {"dtype": "e4m3", "granularity": "1x128", "scale_rule": "amax/448", "bits": 8}}}, r"recipe\.train_fprop\.input.*unknown key.*bits"),
        ({"base": "jet_fp8", "train_backward": {"saved_activations": "e4m3"}}, r"unknown key.*saved_activations"),
        ({"name": "x", "train_fprop": {"input": {"dtype": "e5m2"}}}, r"train_fprop\.input.*dtype 'e5m2'.*e4m3"),
        ({"base": "jet_fp8", "train_fprop": {"input": {"granularity": "2x64"}}}, r"granularity '2x64'.*1x128"),
        ({"base": "jet_fp8", "rollout": {"weight": {"scale_rule": "absmax"}}}, r"scale_rule 'absmax'.*amax/448"),
        ({"base": "jet_fp8", "gemm_backend": "cutlass"}, r"gemm_backend.*cutlass"),
        ({"name": "x", "rollout": {"input": {"dtype": "e4m3"}}}, r"rollout\.input.*e4m3 operand needs a granularity"),
        ({"name": "x", "rollout": {"input": {"dtype": "bf16", "granularity": "1x128"}}}, r"takes no granularity"),
        (
            {"name": "x", "train_backward": {"dgrad_grad_output": {"dtype": "e4m3", "granularity": "1x128", "scale_rule": "amax/448"}}},
            r"FP8 backward needs an FP8 forward",
        ),
        ({"base": "jet_fp8", "train_backward": {"wgrad_input": {"granularity": "1x128"}}}, r"wgrad_input must be grouped along tokens \(128x1\)"),
        ({"base": "jet_fp8", "train_backward": {"wgrad_grad_output": {"granularity": "1x128"}}}, r"wgrad_grad_output.*128x1"),
        ({"base": "jet_fp8", "train_backward": {"dgrad_grad_output": {"granularity": "128x1"}}}, r"dgrad_grad_output must be 1x128"),
        ({"base": "jet_fp8", "train_backward": {"saved_input": {"granularity": "128x1"}}}, r"saved_input.*must equal the fprop input"),
        ({"base": "jet_fp8", "train_backward": {"grad_dtype": "e4m3"}}, r"grad_dtype=e4m3 is not supported"),
        ({"base": "jet_fp8", "rollout": {"weight": {"granularity": "1x128"}}}, r"weight granularity 1x128 is not supported"),
        ({"base": "jet_fp8", "lm_head_dtype": "e4m3"}, r"lm_head_dtype must be bf16 or fp32"),
        ({"base": "no_such_recipe"}, r"unknown recipe 'no_such_recipe'"),
    ],
)
def test_invalid_recipes_give_clear_errors(data, match):
    with pytest.raises(RecipeError, match=match):
        PrecisionRecipe.from_dict(data)


def test_invalid_yaml_shapes():
    with pytest.raises(RecipeError, match="must be a mapping"):
        PrecisionRecipe.from_yaml("- just\n- a list\n")
    with pytest.raises(RecipeError, match="expected a mapping for FpropSpec"):
        PrecisionRecipe.from_yaml("name: x\nrollout: e4m3\n")


def test_direct_construction_is_validated_too():
    with pytest.raises(RecipeError, match="e4m3 operand needs"):
        TensorSpec("e4m3", "1x128")
    with pytest.raises(RecipeError, match="FP8 backward needs an FP8 forward"):
        PrecisionRecipe("x", train_backward=get_recipe("jet_fp8").train_backward)
    with pytest.raises(RecipeError, match="grad_dtype=e4m3"):
        BackwardSpec(grad_dtype="e4m3")
    assert TensorSpec("e4m3", Granularity.BLOCK_1x128, ScaleRule.AMAX_DIV) == E4M3_1x128


def test_get_recipe_errors(tmp_path):
    with pytest.raises(RecipeError, match=r"unknown recipe 'jet_fp16'.*bf16.*fp8_rollout.*jet_fp8"):
        get_recipe("jet_fp16")
    missing = tmp_path / "nope" / "recipe.yaml"
    with pytest.raises(FileNotFoundError, match=r"recipe file .*recipe\.yaml does not exist"):
        get_recipe(str(missing))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        PrecisionRecipe.from_json(tmp_path / "missing.json")
