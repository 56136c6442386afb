"""Precision graphs from live models, check_subgraph on the named recipes and on planted faults."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from precision_testutil import tiny_causal_lm
from jetrl_precision import (
    Fp8Linear,
    FpropSpec,
    PrecisionGraph,
    TensorSpec,
    build_precision_graph,
    check_subgraph,
    convert_to_fp8,
    format_violations,
    fp8_linears,
    get_recipe,
)
from jetrl_precision.graph import add_linear, canonical_name

JET = get_recipe("jet_fp8")
FP8_ROLLOUT = get_recipe("fp8_rollout")
QUANT_FIELDS = ("dtype", "granularity", "scale_rule", "quantizer_id")


def fp8_model(arch: str = "llama", side: str = "train", recipe=JET, **kw) -> nn.Module:
    return convert_to_fp8(tiny_causal_lm(arch, **kw), recipe, side=side)


def keys(violations) -> set[tuple[str, str, str]]:
    return {(v.node, v.edge, v.field) for v in violations}


def bf16_vs_fp8(node: str) -> set[tuple[str, str, str]]:
    """What a linear that is FP8 on one side and high precision on the other must report."""
    return {(node, "", "op")} | {(node, edge, f) for edge in ("input", "weight") for f in QUANT_FIELDS}


# ---- the named recipes ------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_jet_fp8_rollout_is_subgraph_of_train_fwd(arch):
    train = fp8_model(arch)
    g_train = build_precision_graph(train, JET, "train_fwd")
    # Rollout from the same converted model (colocated engine) ...
    assert check_subgraph(build_precision_graph(train, JET, "rollout"), g_train) == []
    # ... and from a separately converted rollout copy (a transformers-based engine).
    rollout = fp8_model(arch, side="rollout")
    g_roll = build_precision_graph(rollout, JET, "rollout")
    assert check_subgraph(g_roll, g_train) == []
    assert check_subgraph(g_roll, g_train, strict=True) == []
    assert format_violations([]).startswith("precision check: OK")
    # The graph really describes FP8 linears (not an empty pass).
    fp8_nodes = {n for n, node in g_roll.nodes.items() if node.op == "linear_fp8"}
    assert fp8_nodes == set(fp8_linears(rollout))
    for n in fp8_nodes:
        edges = g_roll.edges_into(n)
        assert edges["input"].attrs.quantizer_id == "e4m3/1x128/amax/448/div-rne"
        assert edges["weight"].attrs.quantizer_id == "e4m3/128x128/amax/448/div-rne"
        assert edges["weight"].attrs.backend == "emulated"
    # lm_head, embeddings and norms are in the graph, in high precision.
    assert g_roll.nodes["lm_head"].op == "linear" and g_roll.edges_into("lm_head")["weight"].attrs.dtype == "fp32"
    assert g_roll.nodes["model.embed_tokens"].op == "embedding"
    assert g_roll.nodes["model.norm"].op == "norm"


def test_fp8_rollout_reports_every_linear():
    trainer = convert_to_fp8(tiny_causal_lm("llama"), FP8_ROLLOUT)  # the train side stays high precision
    assert not fp8_linears(trainer)
    rollout = fp8_model("llama", side="rollout", recipe=FP8_ROLLOUT)
    violations = check_subgraph(build_precision_graph(rollout, FP8_ROLLOUT, "rollout"), build_precision_graph(trainer, FP8_ROLLOUT, "train_fwd"))
    expected: set = set()
    for name in fp8_linears(rollout):
        expected |= bf16_vs_fp8(name)
    assert keys(violations) == expected
    assert len(violations) == len(expected) == 14 * 9
    dtype_nodes = {v.node for v in violations if v.field == "dtype"}
    assert dtype_nodes == set(fp8_linears(rollout))
    v = next(v for v in violations if v.edge == "input" and v.field == "dtype")
    assert (v.expected, v.found) == ("fp32", "e4m3")
    text = format_violations(violations, limit=5)
    assert f"{len(violations)} violation(s)" in text and "op expected linear, found linear_fp8" in text and "and 121 more" in text
    assert "input]: dtype expected fp32, found e4m3" in format_violations(violations, limit=200)
    # Under strict the backend adds nothing here: only one side runs an FP8 GEMM, already reported as dtype.
    strict = check_subgraph(build_precision_graph(rollout, FP8_ROLLOUT, "rollout"), build_precision_graph(trainer, FP8_ROLLOUT, "train_fwd"), strict=True)
    assert keys(strict) == expected


def test_train_bwd_graph_describes_the_backward_flow():
    g = build_precision_graph(fp8_model("llama"), JET, "train_bwd")
    e = g.edges_into("model.layers.1.mlp.down_proj")
    assert e["dgrad.grad_output"].attrs.granularity == "1x128"
    assert e["dgrad.weight_t"].attrs.granularity == "128x128" and e["dgrad.weight_t"].attrs.block_origin == "transpose"
    assert e["wgrad.grad_output"].attrs.granularity == "128x1" and e["wgrad.input"].attrs.granularity == "128x1"
    assert e["saved.input"].attrs.dtype == "e4m3" and e["saved.input"].attrs.granularity == "1x128"
    assert e["grad_between_ops"].attrs.dtype == "bf16"  # never FP8
    assert "input" not in e  # forward edges belong to train_fwd


# ---- planted faults -------------------------------------------------------------------------------------
def test_layer_left_in_bf16_on_one_side():
    train = fp8_model("llama")
    skip = "model.layers.1.self_attn.v_proj"
    rollout = convert_to_fp8(tiny_causal_lm("llama"), JET, module_filter=lambda m, fqn: fqn != skip and "lm_head" not in fqn, side="rollout")
    assert type(rollout.get_submodule(skip)) is nn.Linear
    g_train = build_precision_graph(train, JET, "train_fwd")
    v = check_subgraph(build_precision_graph(rollout, JET, "rollout"), g_train)
    assert keys(v) == bf16_vs_fp8(skip)
    # The other way round: the trainer left a layer in BF16 that the rollout quantizes.
    train2 = convert_to_fp8(tiny_causal_lm("llama"), JET, module_filter=lambda m, fqn: fqn != skip and "lm_head" not in fqn)
    v2 = check_subgraph(build_precision_graph(fp8_model("llama", side="rollout"), JET, "rollout"), build_precision_graph(train2, JET, "train_fwd"))
    assert keys(v2) == bf16_vs_fp8(skip)


def test_weight_1x128_instead_of_128x128():
    train, rollout = fp8_model("llama"), fp8_model("llama", side="rollout")
    bad = "model.layers.0.mlp.up_proj"
    layer = rollout.get_submodule(bad)
    layer.fprop = FpropSpec(input=layer.fprop.input, weight=TensorSpec("e4m3", "1x128", "amax/448"))
    v = check_subgraph(build_precision_graph(rollout, JET, "rollout"), build_precision_graph(train, JET, "train_fwd"))
    assert keys(v) == {(bad, "weight", "granularity"), (bad, "weight", "quantizer_id")}
    gran = next(x for x in v if x.field == "granularity")
    assert (gran.expected, gran.found) == ("128x128", "1x128")


def test_different_scale_rule():
    train, rollout = fp8_model("llama"), fp8_model("llama", side="rollout")
    w_bad, x_bad = "model.layers.0.self_attn.o_proj", "model.layers.1.mlp.gate_proj"
    lw = rollout.get_submodule(w_bad)
    lw.fprop = FpropSpec(input=lw.fprop.input, weight=TensorSpec("e4m3", "128x128", "amax/448,pow2up"))
    lx = rollout.get_submodule(x_bad)
    lx.fprop = FpropSpec(input=TensorSpec("e4m3", "1x128", "amax/448,pow2up"), weight=lx.fprop.weight)
    v = check_subgraph(build_precision_graph(rollout, JET, "rollout"), build_precision_graph(train, JET, "train_fwd"))
    assert keys(v) == {(w_bad, "weight", "scale_rule"), (w_bad, "weight", "quantizer_id"), (x_bad, "input", "scale_rule"), (x_bad, "input", "quantizer_id")}
    sr = next(x for x in v if x.node == w_bad and x.field == "scale_rule")
    assert (sr.expected, sr.found) == ("amax/448", "amax/448,pow2up")


def engine_rollout_graph(model: nn.Module, recipe, scope: str, backend: str = "emulated", prefix: str = "") -> PrecisionGraph:
    """What a vLLM-style engine reports: fused qkv_proj / gate_up_proj, built with add_linear."""
    g = PrecisionGraph("rollout", recipe.name)
    fprop = recipe.rollout
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        base = f"{prefix}model.layers.{i}"
        k = attn.q_proj.in_features
        sizes = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        add_linear(g, f"{base}.self_attn.qkv_proj", k, sum(sizes), fprop, None, hp_dtype="fp32", backend=backend,
                   part_sizes=sizes, weight_quant_scope=scope)
        add_linear(g, f"{base}.self_attn.o_proj", attn.o_proj.in_features, attn.o_proj.out_features, fprop, None, hp_dtype="fp32", backend=backend)
        gu = [mlp.gate_proj.out_features, mlp.up_proj.out_features]
        add_linear(g, f"{base}.mlp.gate_up_proj", mlp.gate_proj.in_features, sum(gu), fprop, None, hp_dtype="fp32", backend=backend,
                   part_sizes=gu, weight_quant_scope=scope)
        add_linear(g, f"{base}.mlp.down_proj", mlp.down_proj.in_features, mlp.down_proj.out_features, fprop, None, hp_dtype="fp32", backend=backend)
    add_linear(g, f"{prefix}lm_head", model.lm_head.in_features, model.lm_head.out_features, FpropSpec(), None, hp_dtype="fp32", backend=None)
    return g


UNALIGNED = dict(hidden=192, intermediate=320, heads=3, kv_heads=3)


def test_fused_projection_with_unaligned_parts():
    train = fp8_model("llama", **UNALIGNED)
    g_train = build_precision_graph(train, JET, "train_fwd")
    # Per-part weight quantization (each part quantized on its own) matches training exactly.
    assert check_subgraph(engine_rollout_graph(train, JET, "per_part"), g_train) == []
    # Quantizing the fused matrix puts rows of two parts in one 128x128 block: reported on block_origin.
    # q, k, v = 192 rows each: q straddles into k, k starts at row 192; v starts at 384 = 3*128 and is last (fine).
    # gate, up = 320 rows each: gate straddles into up, up starts at row 320.
    v = check_subgraph(engine_rollout_graph(train, JET, "fused"), g_train)
    expected = set()
    for i in range(2):
        for part in ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.up_proj"):
            expected.add((f"model.layers.{i}.{part}", "weight", "block_origin"))
    assert keys(v) == expected
    found = {x.node.rsplit(".", 1)[-1]: x.found for x in v if x.node.startswith("model.layers.0.")}
    assert found == {"q_proj": "fused@0", "k_proj": "fused@192", "gate_proj": "fused@0", "up_proj": "fused@320"}
    assert all(x.expected == "aligned" for x in v)
    # The partial edge blocks are recorded in the graph as zero padding, on both sides alike.
    q = g_train.edges_into("model.layers.0.self_attn.q_proj")
    assert q["weight"].attrs.padding == "N 192->256,K 192->256" and q["input"].attrs.padding == "K 192->256"


def test_fused_projection_with_aligned_parts_passes():
    train = fp8_model("llama")  # q 256, k/v 128 (2 kv heads of 64), gate/up 512: every part starts on a block
    assert check_subgraph(engine_rollout_graph(train, JET, "fused"), build_precision_graph(train, JET, "train_fwd")) == []


def test_canonical_names():
    assert canonical_name("module.model.layers.0.mlp.up_proj") == "model.layers.0.mlp.up_proj"
    assert canonical_name("module._orig_mod.model.norm") == "model.norm"
    assert canonical_name("model.layers.3._checkpoint_wrapped_module.mlp") == "model.layers.3.mlp"
    g = PrecisionGraph("rollout")
    add_linear(g, "module.model.layers.0.self_attn.qkv_proj", 256, 512, JET.rollout, None, hp_dtype="bf16", backend="emulated", part_sizes=[256, 128, 128])
    add_linear(g, "model.layers.0.mlp.gate_up_proj", 256, 1024, JET.rollout, None, hp_dtype="bf16", backend="emulated", part_sizes=[512, 512])
    assert set(g.nodes) == {f"model.layers.0.self_attn.{p}_proj" for p in "qkv"} | {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"}
    assert g.nodes["model.layers.0.self_attn.k_proj"].attrs["out_features"] == 128
    assert g.nodes["model.layers.0.self_attn.k_proj"].attrs["fused_from"] == "model.layers.0.self_attn.qkv_proj"
    with pytest.raises(ValueError, match="part sizes"):
        add_linear(g, "model.layers.0.mlp.gate_up_proj", 256, 1024, JET.rollout, None, hp_dtype="bf16", backend="emulated", part_sizes=[1024])


def test_deepspeed_module_prefix_is_stripped():
    class Engine(nn.Module):  # DeepSpeedEngine / DDP hold the model as `.module`
        def __init__(self, m: nn.Module) -> None:
            super().__init__()
            self.module = m

    train = Engine(fp8_model("llama"))
    g_train = build_precision_graph(train, JET, "train_fwd")
    assert all(not n.startswith("module.") for n in g_train.nodes)
    rollout = fp8_model("llama", side="rollout")
    assert check_subgraph(build_precision_graph(rollout, JET, "rollout"), g_train) == []
    assert check_subgraph(engine_rollout_graph(rollout, JET, "per_part", prefix="module."), g_train) == []


def test_backend_mismatch_is_a_violation_only_when_strict():
    train = fp8_model("llama")
    g_train = build_precision_graph(train, JET, "train_fwd")
    g_roll = engine_rollout_graph(train, JET, "per_part", backend="triton")
    assert check_subgraph(g_roll, g_train) == []
    strict = check_subgraph(g_roll, g_train, strict=True)
    expected = {(n, e, "backend") for n in fp8_linears(train) for e in ("input", "weight")}
    assert keys(strict) == expected
    assert all(v.kind == "backend" and v.expected == "emulated" and v.found == "triton" for v in strict)


def test_missing_node_and_shape_mismatch():
    train = fp8_model("llama")
    g_train = build_precision_graph(train, JET, "train_fwd")
    g = engine_rollout_graph(train, JET, "per_part")
    g.nodes["model.layers.0.mlp.up_proj"].attrs["out_features"] = 640
    add_linear(g, "model.layers.9.mlp.up_proj", 256, 512, JET.rollout, None, hp_dtype="fp32", backend="emulated")
    v = check_subgraph(g, g_train)
    assert keys(v) == {("model.layers.0.mlp.up_proj", "", "out_features"), ("model.layers.9.mlp.up_proj", "", "node")}
    assert {x.kind for x in v} == {"shape", "missing_node"}


def _without(g: PrecisionGraph, *, nodes=(), roles=()) -> PrecisionGraph:
    d = g.to_dict()
    d["nodes"] = [n for n in d["nodes"] if n["name"] not in nodes]
    d["edges"] = [e for e in d["edges"] if e["dst"] not in nodes and e["role"] not in roles]
    return PrecisionGraph.from_dict(d)


def test_a_rollout_graph_that_proves_nothing_is_refused():
    train = fp8_model("llama")
    g_train = build_precision_graph(train, JET, "train_fwd")
    g_roll = build_precision_graph(fp8_model("llama", side="rollout"), JET, "rollout")
    assert check_subgraph(g_roll, g_train) == []
    fp8_ops = set(fp8_linears(train))
    assert len(fp8_ops) == 14
    # An empty graph: every FP8 op of training is missing, and the emptiness itself is named.
    empty = check_subgraph(PrecisionGraph("rollout", "jet_fp8"), g_train)
    assert {v.node for v in empty if v.kind == "missing_node"} == fp8_ops
    assert any(v.kind == "empty_graph" for v in empty)
    # Weight edges dropped: every op that had one reports it (linears, embeddings, norms).
    no_weights = check_subgraph(_without(g_roll, roles=("weight",)), g_train)
    assert keys(no_weights) == {(n, "weight", "edge") for n in g_roll.nodes}
    assert {v.kind for v in no_weights} == {"missing_edge"}
    no_inputs = check_subgraph(_without(g_roll, roles=("input",)), g_train)
    assert {v.node for v in no_inputs} == {n for n, node in g_roll.nodes.items() if node.op.startswith("linear")}
    # A layer missing: its seven FP8 linears are named.
    layer1 = {n for n in g_roll.nodes if n.startswith("model.layers.1.")}
    missing = check_subgraph(_without(g_roll, nodes=layer1), g_train)
    assert {v.node for v in missing} == layer1 & fp8_ops and len(layer1 & fp8_ops) == 7
    assert all(v.kind == "missing_node" and "absent from rollout" in v.found for v in missing)
    # An edge into an op the graph does not have is malformed, not ignored.
    d = g_roll.to_dict()
    d["nodes"] = [n for n in d["nodes"] if n["name"] != "model.layers.0.mlp.down_proj"]
    dangling = check_subgraph(PrecisionGraph.from_dict(d), g_train)
    assert {(v.node, v.kind) for v in dangling} == {("model.layers.0.mlp.down_proj", "missing_node"), ("model.layers.0.mlp.down_proj", "dangling_edge")}
    # A backward graph in place of train_fwd, or a dict in place of a graph: refused with the fix.
    with pytest.raises(ValueError, match="phase='train_fwd'"):
        check_subgraph(g_roll, build_precision_graph(train, JET, "train_bwd"))
    with pytest.raises(TypeError, match="PrecisionGraph.from_dict"):
        check_subgraph(g_roll.to_dict(), g_train)


def test_bf16_layers_are_not_required_in_the_rollout_graph():
    """The recipe keeps lm_head (and a filtered layer) in high precision: a rollout graph without them is not missing an FP8 op."""
    skip = "model.layers.0.mlp.down_proj"
    train = convert_to_fp8(tiny_causal_lm("llama"), JET, module_filter=lambda m, fqn: fqn != skip and "lm_head" not in fqn)
    g_train = build_precision_graph(train, JET, "train_fwd")
    g_roll = _without(build_precision_graph(train, JET, "rollout"), nodes=("lm_head", skip))
    assert check_subgraph(g_roll, g_train) == []


# ---- views and serialization ----------------------------------------------------------------------------------
def test_report_dot_render_and_round_trip(tmp_path):
    train, rollout = fp8_model("llama"), fp8_model("llama", side="rollout")
    bad = "model.layers.0.mlp.up_proj"
    rollout.get_submodule(bad).fprop = FpropSpec(JET.rollout.input, TensorSpec("e4m3", "1x128", "amax/448"))
    g_train = build_precision_graph(train, JET, "train_fwd")
    g_roll = build_precision_graph(rollout, JET, "rollout")
    v = check_subgraph(g_roll, g_train)

    rep = g_train.report()
    assert "precision graph [train_fwd] recipe=jet_fp8" in rep and "gemm_backend=emulated" in rep
    assert "model.layers.1.mlp.down_proj" in rep and "e4m3[1x128]" in rep and "e4m3[128x128]" in rep
    assert len(g_train.report(max_rows=3).splitlines()) < len(rep.splitlines())
    assert g_train.summary()["fp8_edges"] == 28

    dot = g_roll.to_dot(v)
    assert dot.startswith('digraph "rollout"') and dot.rstrip().endswith("}")
    assert dot.count("salmon") == 1 and "e4m3[1x128]" in dot

    out = g_roll.render(tmp_path / "rollout_graph.png", v)
    assert out.suffix == ".png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 1000
    assert (tmp_path / "rollout_graph.dot").read_text() == dot

    for g in (g_train, g_roll, build_precision_graph(train, JET, "train_bwd")):
        d = g.to_dict()
        back = PrecisionGraph.from_dict(json.loads(json.dumps(d)))
        assert back.to_dict() == d
        assert back.edges == g.edges and back.nodes == g.nodes
    assert check_subgraph(PrecisionGraph.from_dict(json.loads(g_roll.to_json())), g_train) == v


def test_build_rejects_bad_phase_and_accepts_recipe_name():
    m = fp8_model("llama", layers=1)
    with pytest.raises(ValueError, match="phase"):
        build_precision_graph(m, JET, "eval")
    assert build_precision_graph(m, "jet_fp8", "train_fwd").recipe == "jet_fp8"


def test_a_norm_whose_forward_another_library_replaced_is_named_in_the_graph():
    """Liger binds its forward and name onto transformers' norm instances; the training graph says which ran."""
    lm = tiny_causal_lm(hidden=128, intermediate=256, layers=1, vocab=64)
    plain = build_precision_graph(lm, "bf16", "train_fwd")
    assert "norm_impl" not in plain.meta
    lm.model.norm._get_name = lambda: "FusedRMSNorm"  # what an instance patch looks like from outside
    g = build_precision_graph(lm, "bf16", "train_fwd")
    assert g.meta["norm_impl"] == "FusedRMSNorm" and g.nodes["model.norm"].attrs["impl"] == "FusedRMSNorm"
    assert "impl=FusedRMSNorm" in g.report() and "impl=" not in plain.report()
    rollout = build_precision_graph(tiny_causal_lm(hidden=128, intermediate=256, layers=1, vocab=64), "bf16", "rollout")
    assert check_subgraph(rollout, g) == []  # a norm kernel is not a precision difference
