"""Planted faults: each one must fail loudly, name the problem and the fix, and keep the last good state.

docs/testing.md lists what this file covers. Library faults run in-process; the training
faults run the real CLI (DeepSpeed on gloo, the transformers engine, a tiny Llama) in a
subprocess, as a user would meet them.
"""

from __future__ import annotations

import pytest
import torch

from precision_testutil import outlier_data, tiny_causal_lm
from jetrl_precision import (
    PrecisionGraph,
    PrecisionRecipe,
    QuantizedTensor,
    RecipeError,
    build_precision_graph,
    check_subgraph,
    convert_to_fp8,
    get_recipe,
    quantize_fp8,
)
from jetrl_precision.weight_sync import WeightSyncError, compare_digests

JET = get_recipe("jet_fp8")


# ---- the library: quantizer input --------------------------------------------------------------------
@pytest.mark.parametrize(
    "make_x, block, error, words",
    [
        (lambda: torch.randn(4, 128).to(torch.float8_e4m3fn), (1, 128), TypeError, "already FP8"),
        (lambda: torch.randn(4, 128).to(torch.float8_e5m2), (1, 128), TypeError, "already FP8"),
        (lambda: torch.randn(4, 128), None, TypeError, "block must be"),
        (lambda: torch.randn(4, 128), (1, 2, 3), TypeError, "block must be"),
        (lambda: torch.randn(4, 128), (1.5, 128), TypeError, "must be ints"),
        (lambda: torch.randn(4, 128), (0, 128), ValueError, "positive"),
        (lambda: torch.randn(4, 128), "2x64", ValueError, "not a granularity"),
        (lambda: torch.randn(128), (1, 128), ValueError, "2-D"),
        (lambda: torch.randn(0, 128), (1, 128), ValueError, "empty"),
        (lambda: torch.ones(4, 128, dtype=torch.int32), (1, 128), TypeError, "floating-point"),
        (lambda: torch.randn(4, 128, device="meta"), (1, 128), ValueError, "meta tensor"),
        (lambda: [[1.0] * 128], (1, 128), TypeError, "torch.Tensor"),
    ],
    ids=["float8_e4m3", "float8_e5m2", "block_None", "block_3d", "block_float", "block_zero", "block_str", "1d", "empty", "int", "meta", "list"],
)
def test_quantizer_refuses_bad_input_by_name(make_x, block, error, words):
    with pytest.raises(error, match=words):
        quantize_fp8(make_x(), block)


def test_quantizer_refuses_nonfinite_input_and_names_the_position():
    x = outlier_data((4, 256))
    x[2, 130] = float("inf")
    with pytest.raises(ValueError, match=r"1 non-finite value\(s\) \(first at index \(2, 130\)\)"):
        quantize_fp8(x)


def test_quantized_tensor_refuses_parts_that_are_not_fp8_bytes_and_fp32_scales():
    qt = quantize_fp8(outlier_data((4, 256)))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        QuantizedTensor(qt.data.float(), qt.scale, qt.block)
    with pytest.raises(TypeError, match="float32"):
        QuantizedTensor(qt.data, qt.scale.double(), qt.block)
    with pytest.raises(ValueError, match="scale shape"):
        QuantizedTensor(qt.data, qt.scale[:, :1], qt.block)
    with pytest.raises(TypeError, match="floating-point"):
        qt.dequantize(torch.int32)


# ---- the library: recipes ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [None, 3, ["jet_fp8"]], ids=["None", "int", "list"])
def test_get_recipe_refuses_a_non_name(name):
    with pytest.raises(RecipeError, match="recipe name"):
        get_recipe(name)


def test_recipe_base_cycles_are_named(tmp_path):
    me = tmp_path / "self.yaml"
    me.write_text(f"name: self\nbase: {me}\n")
    with pytest.raises(RecipeError, match=r"recipe base cycle: .*self\.yaml -> .*self\.yaml"):
        get_recipe(str(me))
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(f"name: a\nbase: {b}\n")
    b.write_text(f"name: b\nbase: {a}\n")
    with pytest.raises(RecipeError, match=r"cycle: .*b\.yaml -> .*a\.yaml -> .*b\.yaml"):
        get_recipe(str(a))
    with pytest.raises(RecipeError, match="base must be"):
        PrecisionRecipe.from_dict({"name": "x", "base": 3})
    # A chain that ends at a named recipe is fine.
    c = tmp_path / "c.yaml"
    c.write_text(f"name: c\nbase: {tmp_path / 'd.yaml'}\n")
    (tmp_path / "d.yaml").write_text("name: d\nbase: jet_fp8\n")
    assert get_recipe(str(c)).name == "c" and get_recipe(str(c)).unified


def test_malformed_recipe_files_name_file_and_line(tmp_path):
    bad_yaml, bad_json = tmp_path / "r.yaml", tmp_path / "r.json"
    bad_yaml.write_text("name: x\nrollout: [\n")
    bad_json.write_text('{"name": ')
    with pytest.raises(RecipeError, match=r"recipe file .*r\.yaml: not valid YAML at line 3"):
        get_recipe(str(bad_yaml))
    with pytest.raises(RecipeError, match=r"recipe file .*r\.json: not valid JSON at line 1, column 10"):
        get_recipe(str(bad_json))
    (tmp_path / "d.yaml").mkdir()
    with pytest.raises(RecipeError, match="cannot be read"):
        get_recipe(str(tmp_path / "d.yaml"))


def test_convert_and_graph_refuse_a_non_recipe():
    with pytest.raises(TypeError, match="PrecisionRecipe or a recipe name"):
        convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(128, 128)), None)
    with pytest.raises(TypeError, match="PrecisionRecipe or a recipe name"):
        build_precision_graph(torch.nn.Linear(128, 128), None, "rollout")
    with pytest.raises(TypeError, match="nn.Module"):
        convert_to_fp8({"weight": torch.zeros(2, 2)}, JET)


# ---- the library: the precision check ------------------------------------------------------------------
def _train_and_rollout():
    train = convert_to_fp8(tiny_causal_lm("llama"), JET)
    return build_precision_graph(train, JET, "train_fwd"), build_precision_graph(train, JET, "rollout")


def test_precision_check_refuses_a_graph_that_proves_nothing():
    g_train, g_roll = _train_and_rollout()
    assert check_subgraph(g_roll, g_train) == []
    assert {v.kind for v in check_subgraph(PrecisionGraph("rollout", "jet_fp8"), g_train)} == {"empty_graph", "missing_node"}
    d = g_roll.to_dict()
    d["edges"] = [e for e in d["edges"] if e["role"] != "weight"]
    assert {v.kind for v in check_subgraph(PrecisionGraph.from_dict(d), g_train)} == {"missing_edge"}
    d = g_roll.to_dict()
    d["nodes"] = [n for n in d["nodes"] if not n["name"].startswith("model.layers.1.")]
    d["edges"] = [e for e in d["edges"] if not e["dst"].startswith("model.layers.1.")]
    missing = check_subgraph(PrecisionGraph.from_dict(d), g_train)
    assert len(missing) == 7 and {v.kind for v in missing} == {"missing_node"}


# ---- the library: the weight-sync digest check ---------------------------------------------------------
SENT = {"a.weight": "d0d0d0d0d0d0d0d0:5c5c5c5c5c5c5c5c", "b.norm": "7e7e7e7e7e7e7e7e"}


@pytest.mark.parametrize(
    "answer, words",
    [
        ({}, "left out 2 tensor"),
        (None, "answered NoneType instead of a name -> digest mapping"),
        ({"a.weight": None, "b.norm": SENT["b.norm"]}, r"could not digest \(None\) 1 tensor\(s\): a.weight"),
        ({"x.weight": SENT["a.weight"], "b.norm": SENT["b.norm"]}, "did not ask about: x.weight"),
        ({**SENT, "extra": "00"}, "did not ask about: extra"),
    ],
    ids=["empty", "None", "None_value", "wrong_name", "extra_name"],
)
def test_digest_check_fails_on_an_answer_that_proves_nothing(answer, words):
    with pytest.raises(WeightSyncError, match=words):
        compare_digests(SENT, answer)


def test_digest_check_fails_on_an_empty_sample():
    with pytest.raises(WeightSyncError, match="sampled no tensors"):
        compare_digests({}, {})


def test_digest_mismatch_shows_the_part_that_differs():
    scale_only = {**SENT, "a.weight": "d0d0d0d0d0d0d0d0:5c5c5c5c5c5c0000"}
    with pytest.raises(WeightSyncError) as info:
        compare_digests(SENT, scale_only)
    msg = str(info.value)
    # The shown parts are the scale digests, cut where they visibly differ (12 characters would look equal).
    assert "a.weight: scales differ: trainer 5c5c5c5c5c5c5c5c engine 5c5c5c5c5c5c0000" in msg
    assert "scales differ" in msg and "FP8 data equal" in msg and "b.norm" not in msg
    data_only = {**SENT, "a.weight": "d0d0d0d0d0d0ffff:5c5c5c5c5c5c5c5c"}
    with pytest.raises(WeightSyncError, match="FP8 data differs.*scales equal"):
        compare_digests(SENT, data_only)
    with pytest.raises(WeightSyncError, match="trainer sent FP8 bytes \\+ scales, engine holds a high-precision tensor"):
        compare_digests(SENT, {**SENT, "a.weight": "d0d0d0d0d0d0d0d0"})
    with pytest.raises(WeightSyncError, match="changed the tensor after the sync"):
        compare_digests(SENT, {**SENT, "b.norm": "modified-after-sync:1234"})
    assert compare_digests(SENT, dict(SENT)) == []
