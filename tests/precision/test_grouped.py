"""Stacked sibling projections (`jetrl_precision.grouped`): q/k/v and gate/up as one FP8 GEMM.

What must hold, on CPU (the emulated GEMM rounds each output element once from an exact float64 sum, so the
arithmetic each path asks for is visible bit for bit):
- forward outputs and weight gradients are the separate layers' bits; the input gradient is the single rounding of
  the stacked DGrad (Q(dY_stacked) . Q(W_stacked)), no longer a bf16 sum of per-layer roundings;
- the members' cached FP8 weights (what the weight sync sends) are the separately quantized bytes, held as views of
  the group's one buffer, and follow optimizer steps;
- every member is still called (its hooks run), its output takes in-place writes, and an output outside the loss
  leaves its member without a gradient, as separate layers do;
- a sibling gets the group's columns only for the very tensor, unmodified, in the same grad mode; otherwise it
  computes its own, and a group whose members do not read one input turns itself off, warned once;
- ineligible groups (rows off the 128-row blocks, mixed backends), ZeRO-3 weights, installed engine weights and
  inference tensors run separately; batch-invariant mode undoes the stacking.
The GPU side (the cuBLASLt / DeepGEMM stacked GEMMs and their speed) is tests/gpu/test_grouped_gpu.py and
benchmarks/stacked_projections_gpu.py.
"""

from __future__ import annotations

import copy
import gc
import io
import logging
import weakref

import pytest
import torch
from precision_testutil import outlier_data, sqnr_db, tiny_causal_lm
from torch import nn

from jetrl_precision import (
    build_precision_graph,
    convert_to_fp8,
    fuse_projections,
    get_recipe,
    mark_weights_updated,
    quantize_fp8,
    unfuse_projections,
)
from jetrl_precision.grouped import Fp8LinearGroup, projection_groups

JET = get_recipe("jet_fp8")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


class _Attn(nn.Module):
    """q/k/v of one input, as transformers' attention calls them (bias like Qwen2 optional)."""

    def __init__(self, h: int = 256, nq: int = 256, nkv: int = 128, bias: bool = False) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(h, nq, bias=bias), nn.Linear(h, nkv, bias=bias), nn.Linear(h, nkv, bias=bias)

    def forward(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


def _pair(bias: bool = False, seed: int = 0, **kw) -> tuple[nn.Module, nn.Module]:
    """The same bf16 weights converted twice: stacked and separate."""
    torch.manual_seed(seed)
    base = _Attn(bias=bias, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in base.parameters():
            p.copy_(outlier_data(tuple(p.shape), generator=g, spike_factor=30.0) * 0.05)
    base = base.to(torch.bfloat16)
    stacked, separate = copy.deepcopy(base), copy.deepcopy(base)
    convert_to_fp8(stacked, JET)
    convert_to_fp8(separate, JET, fuse_projections=False)
    return stacked, separate


def _x(rows: int = 200, h: int = 256, seed: int = 1) -> torch.Tensor:
    return outlier_data((2, rows // 2, h), generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _run(model: nn.Module, x: torch.Tensor, weights=(1.0, -0.5, 2.0)):
    model.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_(True)
    outs = model(xx)
    loss = sum(w * o.float().pow(2).mean() for w, o in zip(weights, outs) if o is not None)
    loss.backward()
    return [o.detach() for o in outs], xx.grad, {n: p.grad for n, p in model.named_parameters()}


# ---- numerics --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [False, True])
def test_outputs_and_weight_grads_are_the_separate_layers_bits(bias):
    stacked, separate = _pair(bias=bias)
    assert [g.label for g in projection_groups(stacked)] == ["q_proj+k_proj+v_proj"] and not projection_groups(separate)
    x = _x()
    ys, dxs, gs = _run(stacked, x)
    yr, dxr, gr = _run(separate, x)
    for a, b in zip(ys, yr):
        assert torch.equal(_bits(a), _bits(b))
    assert ys[0].shape == (2, 100, 256) and ys[1].shape == (2, 100, 128)
    for name in gr:
        assert torch.equal(_bits(gs[name]), _bits(gr[name])), name
    # DGrad: the stacked GEMM's one rounding of Q(dY_stacked) . Q(W_stacked), exactly.
    dy = torch.cat([(w * 2.0 / o.numel()) * o.float() for w, o in zip((1.0, -0.5, 2.0), ys)], dim=-1)
    dy = dy.to(torch.bfloat16).reshape(-1, 512)
    w = torch.cat([stacked.q_proj.weight, stacked.k_proj.weight, stacked.v_proj.weight]).detach()
    want = (quantize_fp8(dy, (1, 128)).dequantize(torch.float64) @ quantize_fp8(w, (128, 128)).dequantize(torch.float64))
    assert torch.equal(_bits(dxs.reshape(-1, 256)), _bits(want.to(torch.bfloat16)))
    # Separate layers round three partial products and autograd sums them in bf16: other bits, the same values to
    # bf16 rounding (measured 51-62 dB against the stacked product's one rounding).
    assert not torch.equal(_bits(dxr), _bits(dxs)) and sqnr_db(want, dxr.reshape(-1, 256)) > 40


def test_outputs_take_in_place_writes_and_an_unused_one_no_gradient():
    stacked, separate = _pair()
    x = _x()
    grads = []
    for model in (stacked, separate):
        model.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(True)
        q, k, v = model(xx)
        q.mul_(0.5)  # what some attention code does to its query; an nn.Linear's output takes it
        (q.float().pow(2).sum() + k.float().sum()).backward()  # v is computed, never used in the loss
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in ("q_proj.weight", "k_proj.weight"):
        assert torch.equal(_bits(grads[0][name]), _bits(grads[1][name])), name
    assert grads[0]["v_proj.weight"] is None and grads[1]["v_proj.weight"] is None


def test_every_member_is_called_and_its_hooks_run():
    stacked, _ = _pair()
    calls = []
    for name in ("q_proj", "k_proj", "v_proj"):
        layer = getattr(stacked, name)
        layer.register_forward_pre_hook(lambda m, args, name=name: calls.append(("pre", name)))
        layer.register_forward_hook(lambda m, args, out, name=name: calls.append(("post", name, tuple(out.shape))))
    stacked(_x())
    assert calls == [("pre", "q_proj"), ("post", "q_proj", (2, 100, 256)), ("pre", "k_proj"), ("post", "k_proj", (2, 100, 128)),
                     ("pre", "v_proj"), ("post", "v_proj", (2, 100, 128))]


def test_side_by_side_gradients_are_read_without_a_copy():
    stacked, _ = _pair()
    group = stacked.q_proj._group
    both = torch.randn(2, 50, 512)  # what the fused SwiGLU backward writes for stacked inputs: one buffer
    gy = group.stacked_grad([both[..., :256], both[..., 256:384], both[..., 384:]])
    assert gy._base is both and torch.equal(gy, both.view(100, 512))
    apart = group.stacked_grad([both[..., :256].contiguous(), None, both[..., 384:].contiguous()])
    assert apart._base is None and torch.equal(apart[:, :256], gy[:, :256]) and not apart[:, 256:384].any()


def test_no_grad_forward_and_the_transformers_model():
    stacked, separate = _pair()
    x = _x()
    with torch.no_grad():
        for a, b in zip(stacked(x), separate(x)):
            assert torch.equal(_bits(a), _bits(b))
    lm32 = tiny_causal_lm(dtype=torch.float32)  # hidden 256, k/v 128 rows, MLP 512: both groups stack
    lm, ref = copy.deepcopy(lm32).to(torch.bfloat16), copy.deepcopy(lm32).to(torch.bfloat16)
    convert_to_fp8(lm, JET)
    convert_to_fp8(ref, JET, fuse_projections=False)
    assert sorted({g.label for g in projection_groups(lm)}) == ["gate_proj+up_proj", "q_proj+k_proj+v_proj"]
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    lm.gradient_checkpointing_enable()
    ref.gradient_checkpointing_enable()
    lm.train(), ref.train()
    a, b = lm(input_ids=ids).logits, ref(input_ids=ids).logits
    assert torch.equal(_bits(a), _bits(b))
    for m, logits in ((lm, a), (ref, b), (lm32, lm32(input_ids=ids).logits)):
        logits.float().pow(2).mean().backward()
    # DGrad's other summation moves FP8 roundings upstream, so earlier layers' gradients differ in bits; against
    # the fp32 model's they are as good as the separate layers' (measured within 0.2 dB; both 15-25 dB; a wrong
    # DGrad loses more than 10 dB).
    for (name, p), (_, q), (_, r) in zip(lm.named_parameters(), ref.named_parameters(), lm32.named_parameters()):
        stacked_db, separate_db = sqnr_db(r.grad, p.grad), sqnr_db(r.grad, q.grad)
        assert stacked_db >= 12.0 and stacked_db >= separate_db - 2.0, (name, stacked_db, separate_db)
    assert all(g._stash is None for g in projection_groups(lm))  # every computed column was taken


# ---- the weights ------------------------------------------------------------------------------------------------
def test_member_weights_are_views_of_one_buffer_with_the_separate_bytes():
    stacked, _ = _pair()
    x = _x()
    _run(stacked, x)
    group = stacked.q_proj._group
    buf = group._wq_cache[1]
    start = buf.data.untyped_storage().data_ptr()
    for layer in (stacked.q_proj, stacked.k_proj, stacked.v_proj):
        wq = layer.quantized_weight()
        assert wq.data.untyped_storage().data_ptr() == start  # no memory of its own
        ref = quantize_fp8(layer.weight.detach(), (128, 128))
        assert torch.equal(_bits(wq.data), _bits(ref.data)) and torch.equal(wq.scale, ref.scale)


def test_weights_follow_the_optimizer_step():
    stacked, separate = _pair()
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (stacked, separate)]
    x = _x()
    for step in range(3):
        outs = []
        for model, opt in zip((stacked, separate), opts):
            outs.append(_run(model, x))
            opt.step()
        mark_weights_updated()
        if step == 1:  # the weight sync's order: members read before the next forward
            for layer in (stacked.q_proj, stacked.k_proj, stacked.v_proj):
                want = quantize_fp8(layer.weight.detach(), (128, 128))
                assert torch.equal(_bits(layer.quantized_weight().data), _bits(want.data))
        assert torch.equal(_bits(outs[0][0][1]), _bits(outs[1][0][1])), step
    assert stacked.q_proj._group._wq_cache is None  # dropped at the step: it holds the old weights' bytes
    _run(stacked, x)
    assert stacked.q_proj._group._wq_cache is not None


def _pickled(module: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_copies_and_pickles_keep_the_groups_apart():
    stacked, _ = _pair()
    _run(stacked, _x())
    for clone in (copy.deepcopy(stacked), _pickled(stacked)):
        g = clone.q_proj._group
        assert isinstance(g, Fp8LinearGroup) and g is not stacked.q_proj._group
        assert g.members == (clone.q_proj, clone.k_proj, clone.v_proj) and g._wq_cache is None
        for a, b in zip(clone(_x()), stacked(_x())):
            assert torch.equal(_bits(a), _bits(b))
    # A member copied without its parent has no group to run in: it computes its own output, the same bits.
    lone = copy.deepcopy(stacked.k_proj)
    assert lone._group is None and stacked.k_proj._group is not None
    assert torch.equal(_bits(lone(_x())), _bits(stacked(_x())[1]))
    # An undone group stays undone in its copies.
    unfuse_projections(stacked)
    assert all(m._group is None for m in (copy.deepcopy(stacked).q_proj, _pickled(stacked).v_proj))


def test_a_deleted_model_is_freed_without_the_cycle_collector_and_a_whole_model_pickles():
    # Members point at their group weakly (the parent holds it), so the group adds no reference cycle: a converted
    # model's memory returns at `del`, as a plain transformers model's does, not at the next gc.collect().
    lm = tiny_causal_lm(dtype=torch.bfloat16)
    convert_to_fp8(lm, JET)
    assert len(projection_groups(lm)) == 4
    ids = torch.randint(0, 512, (2, 24))
    lm(ids).logits.float().pow(2).mean().backward()
    with torch.no_grad():  # the whole converted model pickles (its step plans and FP8 caches are left behind)
        assert torch.equal(_pickled(lm)(ids).logits, lm(ids).logits)
    weight = weakref.ref(lm.model.layers[0].self_attn.q_proj.weight)
    gc.disable()
    try:
        del lm
        assert weight() is None
    finally:
        gc.enable()


def test_a_new_parent_adopts_the_groups_or_their_loss_is_named(caplog):
    import jetrl_precision.linear as linear_mod
    from jetrl_precision.swiglu import fuse_swiglu

    # fuse_swiglu after convert_to_fp8 (as its docstring allows): the SwiGLU module adopts gate/up's group.
    lm = tiny_causal_lm(dtype=torch.bfloat16)
    convert_to_fp8(lm, JET, fuse_swiglu=False)
    assert fuse_swiglu(lm) == 2
    gc.collect()
    assert len(projection_groups(lm)) == 4 and all(layer.mlp.fused_dy_quantization for layer in lm.model.layers)
    assert lm.model.layers[0].mlp.gate_proj._group.members == (lm.model.layers[0].mlp.gate_proj, lm.model.layers[0].mlp.up_proj)
    # Surgery that moves the children to a parent of its own: the group goes with the old parent, the members run
    # alone (the forward's bytes are the separate layers'), and the first to notice says so, once.
    stacked, separate = _pair()
    moved = _Attn()
    moved.q_proj, moved.k_proj, moved.v_proj = stacked.q_proj, stacked.k_proj, stacked.v_proj
    del stacked
    linear_mod._lost_group_logged.clear()
    x = _x()
    with caplog.at_level(logging.WARNING, logger="jetrl_precision.linear"):
        for _ in range(2):
            for a, b in zip(moved(x), separate(x)):
                assert torch.equal(_bits(a), _bits(b))
    lost = [r for r in caplog.records if "fuse_projections(model) again" in r.getMessage()]
    assert len(lost) == 1 and not projection_groups(moved)
    assert "fuse_projections" in build_precision_graph(moved, JET, "train_fwd").nodes["v_proj"].attrs["fused_gemm_off"]
    assert fuse_projections(moved) == 1 and moved.q_proj._group is not None


# ---- when siblings may share the GEMM --------------------------------------------------------------------------
def test_another_input_gets_its_own_gemm_and_the_group_turns_off_once(caplog):
    stacked, separate = _pair()
    x = _x()
    other = _x(seed=5)
    with caplog.at_level(logging.WARNING, logger="jetrl_precision.grouped"):
        for _ in range(3):
            got = (stacked.q_proj(x), stacked.k_proj(other), stacked.v_proj(x))
            want = (separate.q_proj(x), separate.k_proj(other), separate.v_proj(x))
            for a, b in zip(got, want):
                assert torch.equal(_bits(a), _bits(b))
    group = stacked.q_proj._group
    assert group.off is not None and "did not read one input" in group.off
    assert len([r for r in caplog.records if "did not read one input" in r.getMessage()]) == 1
    node = build_precision_graph(stacked, JET, "train_fwd").nodes["q_proj"]
    assert "did not read one input" in node.attrs["fused_gemm_off"]


def test_an_input_written_in_place_between_siblings_is_recomputed():
    stacked, separate = _pair()
    with torch.no_grad():
        x = _x()
        x0 = x.clone()
        q = stacked.q_proj(x)
        x.mul_(3.0)  # bumps the version counter: the kept k/v columns belong to the old values
        k = stacked.k_proj(x)
        v = stacked.v_proj(x)
        assert torch.equal(_bits(q), _bits(separate.q_proj(x0)))
        assert torch.equal(_bits(k), _bits(separate.k_proj(x))) and torch.equal(_bits(v), _bits(separate.v_proj(x)))


def test_a_stash_from_no_grad_is_not_handed_to_a_grad_call():
    stacked, _ = _pair()
    x = _x().requires_grad_(True)
    with torch.no_grad():
        stacked.q_proj(x)
    k = stacked.k_proj(x)  # grad mode now: its own computation, with a graph
    assert k.requires_grad and k.grad_fn is not None


def test_inference_tensors_zero3_and_installed_weights_run_separately():
    stacked, separate = _pair()
    group = stacked.q_proj._group
    with torch.inference_mode():
        x = _x()
        for a, b in zip(stacked(x), separate(x)):
            assert torch.equal(_bits(a), _bits(b))
    assert group._stash is None and group._wq_cache is None
    stacked.k_proj.weight.ds_id = 7  # what DeepSpeed ZeRO-3 marks its partitioned parameters with
    try:
        with torch.no_grad():
            stacked(_x())
        assert group._stash is None and group._wq_cache is None
    finally:
        del stacked.k_proj.weight.ds_id
    stacked.v_proj.install_quantized_weight(quantize_fp8(stacked.v_proj.weight.detach(), (128, 128)))
    with torch.no_grad():
        stacked(_x())
    assert group._stash is None and group._wq_cache is None


def test_ineligible_siblings_stay_separate_and_say_why(caplog):
    torch.manual_seed(0)
    odd = _Attn(h=192, nq=192, nkv=64).to(torch.bfloat16)  # SmolLM2-like: q_proj ends mid-block
    with caplog.at_level(logging.WARNING, logger="jetrl_precision.grouped"):
        convert_to_fp8(odd, JET)
    assert not projection_groups(odd)
    assert any("192 rows, not a multiple of 128" in r.getMessage() for r in caplog.records)
    graph = build_precision_graph(odd, JET, "train_fwd")
    assert "not a multiple of 128" in graph.nodes["k_proj"].attrs["fused_gemm_off"]
    mixed = _Attn().to(torch.bfloat16)
    convert_to_fp8(mixed, JET, fuse_projections=False)
    mixed.k_proj.gemm_backend = "triton"
    assert fuse_projections(mixed) == 0 and "gemm_backend differ" in mixed.q_proj._group_skipped
    # Fused groups show in the graph (a node attribute: engine-vs-trainer checks compare edges, not this).
    stacked, _ = _pair()
    graph = build_precision_graph(stacked, JET, "train_fwd")
    assert graph.nodes["v_proj"].attrs["fused_gemm"] == "q_proj+k_proj+v_proj"


def test_unfuse_and_batch_invariant_mode_undo_it():
    from jetrl_precision.batch_invariant import make_batch_invariant
    from openrlhf.models.invariant_attention import register_invariant_attention

    stacked, _ = _pair()
    assert unfuse_projections(stacked) == 1 and not projection_groups(stacked) and stacked.q_proj._group is None
    lm = tiny_causal_lm(dtype=torch.float32)
    lm.set_attn_implementation(register_invariant_attention())
    convert_to_fp8(lm, JET)
    assert len(projection_groups(lm)) == 4
    make_batch_invariant(lm)
    assert not projection_groups(lm)


def test_a_stacked_gemm_that_disagrees_with_its_members_turns_the_group_off(monkeypatch, caplog):
    """The first stacked GEMM of a group is checked against the members' own GEMMs: a misread stacked weight (here
    k's and v's rows swapped) is caught before its output is used, and the members run separately from then on."""
    stacked, separate = _pair()
    real = Fp8LinearGroup._weight_operands

    def swapped(self, weight, plan):
        wq, prepared, cached = real(self, weight, plan)
        data = torch.cat([wq.data[:256], wq.data[384:], wq.data[256:384]])
        scale = torch.cat([wq.scale[:2], wq.scale[3:], wq.scale[2:3]])
        return type(wq).trusted(data, scale, wq.block), prepared, False

    monkeypatch.setattr(Fp8LinearGroup, "_weight_operands", swapped)
    x = _x()
    with caplog.at_level(logging.WARNING, logger="jetrl_precision.grouped"):
        got = stacked(x)
        got2 = stacked(x)
    for a, b, c in zip(got, got2, separate(x)):
        assert torch.equal(_bits(a), _bits(c)) and torch.equal(_bits(b), _bits(c))
    group = stacked.q_proj._group
    assert group.off is not None and "differs from their own GEMMs" in group.off
    assert sum("differs from their own GEMMs" in r.getMessage() for r in caplog.records) == 1
    # A sound stacked GEMM passes the check once, and the check does not run again after optimizer steps.
    fine, _ = _pair()
    monkeypatch.setattr(Fp8LinearGroup, "_weight_operands", real)
    fine(x)
    assert fine.q_proj._group.off is None and fine.q_proj._group._checked
    mark_weights_updated()
    assert fine.q_proj._group._checked
