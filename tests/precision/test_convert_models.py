"""convert_to_fp8 on real transformers models (tiny Llama / Qwen2 built from configs) and FP8 training.

The training test runs 30 AdamW steps of next-token prediction on a fixed synthetic set
(a random 4-successor Markov chain: irreducible entropy ln 4, so the loss stays far from 0
and relative comparisons are meaningful) and checks the FP8 loss curve against the
unconverted model's at every step.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from precision_testutil import sqnr_db, tiny_causal_lm
from jetrl_precision import Fp8Linear, convert_to_fp8, fp8_linears, get_recipe

JET = get_recipe("jet_fp8")
pytestmark = pytest.mark.usefixtures("single_thread")
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

MODELS = {
    "llama": dict(arch="llama"),
    "qwen2": dict(arch="qwen2"),
    # dims that are not multiples of 128: partial blocks along K and N everywhere
    "llama_unaligned": dict(arch="llama", hidden=192, intermediate=320, heads=3, kv_heads=3),
}


def expected_fp8_names(layers: int = 2) -> set[str]:
    return {f"model.layers.{i}.{p}" for i in range(layers) for p in PROJ}


@pytest.mark.parametrize("name", list(MODELS))
def test_convert_swaps_projections_only(name):
    model = tiny_causal_lm(**MODELS[name])
    before = {n: p for n, p in model.named_parameters()}
    keys_before = list(model.state_dict().keys())
    out = convert_to_fp8(model, JET)
    assert out is model  # in place
    fp8 = fp8_linears(model)
    assert set(fp8) == expected_fp8_names()
    for fqn, layer in fp8.items():
        assert layer.fqn == fqn and layer.fprop == JET.train_fprop and layer.backward_spec == JET.train_backward
    # Untouched: lm_head (plain nn.Linear), embeddings, norms.
    assert type(model.lm_head) is nn.Linear
    assert type(model.model.embed_tokens) is nn.Embedding
    for mod_name, mod in model.named_modules():
        if "norm" in mod_name:
            assert not isinstance(mod, nn.Linear) and type(mod).__name__.endswith("RMSNorm")
    # Same Parameter objects, same names: optimizers and checkpoints see no difference.
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert list(model.state_dict().keys()) == keys_before
    if name == "qwen2":  # Qwen2 has q/k/v biases: they are carried over
        assert fp8["model.layers.0.self_attn.q_proj"].bias is before["model.layers.0.self_attn.q_proj.bias"]


def test_convert_with_custom_filter_and_bf16_noop():
    model = tiny_causal_lm("llama")
    convert_to_fp8(model, "jet_fp8", module_filter=lambda m, fqn: fqn.endswith("mlp.down_proj"))
    assert set(fp8_linears(model)) == {"model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"}
    # Recipes without an FP8 forward on the chosen side leave the model untouched.
    for recipe, side in (("bf16", "train"), ("bf16", "rollout"), ("fp8_rollout", "train")):
        m = tiny_causal_lm("llama")
        convert_to_fp8(m, recipe, side=side)
        assert not fp8_linears(m)
    m = tiny_causal_lm("llama")
    convert_to_fp8(m, "fp8_rollout", side="rollout")
    layers = fp8_linears(m)
    assert set(layers) == expected_fp8_names()
    assert all(l.backward_spec is None for l in layers.values())
    with pytest.raises(ValueError, match="side"):
        convert_to_fp8(m, "jet_fp8", side="eval")


@pytest.mark.parametrize("name", list(MODELS))
def test_converted_forward_backward_close_to_bf16(name):
    base = tiny_causal_lm(**MODELS[name], dtype=torch.bfloat16)
    fp8 = convert_to_fp8(copy.deepcopy(base), JET)
    ids = torch.randint(0, 512, (2, 64))
    lb = base(input_ids=ids).logits
    lf = fp8(input_ids=ids).logits
    assert lf.dtype == torch.bfloat16
    assert sqnr_db(lb.float(), lf.float()) >= 20.0
    loss = fp8(input_ids=ids, labels=ids).loss
    loss.backward()
    for n, p in fp8.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all(), n


# ---- training --------------------------------------------------------------------------------------
def markov_dataset(n_seq: int = 64, seq_len: int = 64, vocab: int = 512, fanout: int = 4, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, fanout), generator=g)
    seq = torch.empty(n_seq, seq_len, dtype=torch.long)
    seq[:, 0] = torch.randint(0, vocab, (n_seq,), generator=g)
    for t in range(1, seq_len):
        seq[:, t] = successors[seq[:, t - 1], torch.randint(0, fanout, (n_seq,), generator=g)]
    return seq


def train_losses(model: nn.Module, data: torch.Tensor, steps: int = 30, batch: int = 8, lr: float = 1e-3) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        start = (step * batch) % data.shape[0]
        ids = data[start : start + batch]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_fp8_training_tracks_bf16_loss_curve(name):
    data = markov_dataset()
    base = tiny_causal_lm(**MODELS[name], dtype=torch.float32)
    fp8 = convert_to_fp8(copy.deepcopy(base), JET)
    assert len(fp8_linears(fp8)) == 14
    ref = train_losses(base, data)
    got = train_losses(fp8, data)
    # The FP8 model learns: a clear, sustained decrease.
    assert got[-1] < 0.8 * got[0], got
    assert sum(got[-5:]) / 5 < sum(got[:5]) / 5 - 1.0
    # And it stays within 5% of the high-precision curve at every step (final loss included).
    rel = [abs(g - r) / r for g, r in zip(got, ref)]
    assert max(rel) <= 0.05, f"max relative gap {max(rel):.3f} at step {rel.index(max(rel))}; fp8 {got} vs ref {ref}"
    assert abs(got[-1] - ref[-1]) / ref[-1] <= 0.05
    # The two runs really differ (the FP8 path was used, not silently skipped).
    assert any(g != r for g, r in zip(got[1:], ref[1:]))
    # The weight cache followed the optimizer: every layer's cached bytes are those of the final weights.
    from jetrl_precision import quantize_fp8

    for layer in fp8_linears(fp8).values():
        wq = layer.quantized_weight()
        assert torch.equal(wq.data.view(torch.uint8), quantize_fp8(layer.weight.detach(), (128, 128)).data.view(torch.uint8))


def test_one_definition_of_fp8_layers():
    """convert_to_fp8 and the weight sync's expected engine digests both ask `recipe.keeps_high_precision`:
    with a custom pattern list, the converted layers and the layers an fp8_rollout engine quantizes coincide."""
    from jetrl_precision.weight_sync import digest, expected_engine_digests

    recipe = JET.replace(keep_high_precision=("*lm_head*", "*embed*", "*norm*", "*layers.0.mlp.*"))
    assert recipe.keeps_high_precision("model.layers.0.mlp.up_proj") and recipe.keeps_high_precision("lm_head")
    assert not recipe.keeps_high_precision("model.layers.1.mlp.up_proj")
    assert not recipe.keeps_high_precision("model.layers.0.self_attn.q_proj")

    converted = set(fp8_linears(convert_to_fp8(tiny_causal_lm(arch="llama"), recipe)))
    linears = {n for n, m in tiny_causal_lm(arch="llama").named_modules() if type(m) is nn.Linear}
    assert converted == {n for n in linears if not recipe.keeps_high_precision(n)}
    assert converted == expected_fp8_names() - {f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}

    # A bf16 trainer beside a quantizing engine (fp8_rollout): the engine quantizes exactly the same layers.
    plain = tiny_causal_lm(arch="llama")
    quantized = expected_engine_digests(plain, fp8=False, engine_recipe=recipe)
    as_is = {n: digest(p) for n, p in plain.named_parameters()}
    engine_fp8 = {n.rsplit(".", 1)[0] for n in quantized if quantized[n] != as_is[n]}
    assert engine_fp8 == converted


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_activation_checkpointing_gives_the_same_fp8_gradients(reentrant):
    """`--actor.gradient_checkpointing_enable` (what 8B recipes run) recomputes each layer's forward in backward: the
    FP8 layers must quantize the same bytes again, so loss and every gradient equal the run without it, bit for bit."""
    torch.manual_seed(0)
    base = tiny_causal_lm(arch="llama")
    ids = torch.randint(0, base.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    out = {}
    for ckpt in (False, True):
        model = convert_to_fp8(copy.deepcopy(base), JET)
        model.train()
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        calls, down = [], model.model.layers[0].mlp.down_proj
        # counted in forward itself: a non-reentrant recompute does not run module hooks
        down.forward = lambda x, fwd=down.forward: (calls.append(1), fwd(x))[1]
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        assert len(calls) == (2 if ckpt else 1), "checkpointing must recompute the layer's forward in backward"
        out[ckpt] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (loss0, g0), (loss1, g1) = out[False], out[True]
    assert torch.equal(loss0, loss1)
    assert g0.keys() == g1.keys() and any(".mlp.down_proj." in n for n in g0)
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n
