"""Sample packing (--ds.packing_samples): the FP8 path quantizes packed tokens exactly as unpacked ones.

Activations are quantized in 1x128 groups along K, the hidden dimension of one token, so a
group never spans two tokens: packing changes which tokens sit next to each other, never the
bytes of a token. Checked on the quantizer alone and through a whole converted model.
"""

from __future__ import annotations

import pytest
import torch

from precision_testutil import assert_within, matmul_bound
from jetrl_precision import convert_to_fp8, get_recipe, quantize_fp8
from openrlhf.models.actor import Actor, Critic, load_causal_lm
from openrlhf.models.packing import pack_batch, unpack_to_actions
from openrlhf.utils.tiny_model import TinyModelSpec, build_tiny_model


def _padded_batch(lengths_prompt, lengths_resp, vocab=100, seed=0):
    """Rows laid out as training lays them: [left-padded prompt | right-padded response]."""
    g = torch.Generator().manual_seed(seed)
    P, R = max(lengths_prompt), max(lengths_resp)
    B = len(lengths_prompt)
    seq = torch.zeros(B, P + R, dtype=torch.long)
    mask = torch.zeros(B, P + R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(lengths_prompt, lengths_resp)):
        seq[i, P - p : P + r] = torch.randint(4, vocab, (p + r,), generator=g)
        mask[i, P - p : P + r] = 1
    return seq, mask, R


def _bytes_equal(a, b):
    return torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)


def test_packed_rows_quantize_to_the_same_bytes(make_outliers):
    """The quantizer alone: packed tokens = the unpacked batch's real tokens, byte for byte."""
    seq, mask, R = _padded_batch([5, 1, 9, 3], [7, 2, 4, 11])
    B, L = seq.shape
    K = 384  # three 1x128 groups per token
    x = make_outliers((B * L, K), dtype=torch.bfloat16).reshape(B, L, K)
    valid = mask.bool()
    padded_q = quantize_fp8(x.reshape(-1, K), block=(1, 128))
    packed_q = quantize_fp8(x[valid], block=(1, 128))
    rows = valid.flatten().nonzero().squeeze(1)
    assert torch.equal(packed_q.data.view(torch.uint8), padded_q.data[rows].view(torch.uint8))
    assert torch.equal(packed_q.scale, padded_q.scale[rows])


def test_pack_batch_layout():
    seq, mask, R = _padded_batch([2, 3], [3, 1])
    packed = pack_batch(seq, mask, R)
    assert packed.input_ids.tolist() == [seq[0, 1:6].tolist() + seq[1, 0:4].tolist()]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    # Response tokens: row 0 columns 0..2 at packed 2..4; row 1 column 0 at packed 8.
    assert packed.target_index.tolist() == [2, 3, 4, 8]
    assert unpack_to_actions(torch.tensor([1.0, 2.0, 3.0, 4.0]), packed).tolist() == [[1, 2, 3], [4, 0, 0]]
    gap = mask.clone()
    gap[0, 3] = 0
    with pytest.raises(ValueError, match="contiguous"):
        pack_batch(seq, gap, R)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("packing_model"), TinyModelSpec(seed=3))


def _capture_quantized_inputs(monkeypatch):
    import jetrl_precision.linear as linear_mod

    calls = []
    real = linear_mod.ops.quantize

    def spy(x, spec):
        q = real(x, spec)
        if q.block == (1, 128):  # activations; weights (128x128) are quantized once and cached
            calls.append(q)
        return q

    monkeypatch.setattr(linear_mod.ops, "quantize", spy)
    return calls


def test_packed_forward_quantizes_every_fp8_linear_input_like_unpacked(tiny_path, monkeypatch):
    """Through a whole jet_fp8 model: every FP8 linear's quantized input bytes (and scales) of the
    packed forward equal the unpacked forward's bytes at the real tokens, layer after layer, and
    so do the log-probs. The float64 batch-invariant attention and the emulated GEMM make the
    two layouts compute identical activations; the quantizer must then add no difference."""
    recipe = get_recipe("jet_fp8")
    model = load_causal_lm(str(tiny_path), torch.float32, "jetrl_invariant")
    convert_to_fp8(model, recipe, side="train")
    seq, mask, R = _padded_batch([5, 1, 9, 3], [7, 2, 4, 11], vocab=model.config.vocab_size)
    with torch.no_grad():
        Actor(model)(seq, mask, R)  # the stacked projections' one-time check quantizes extra rows on the first call
    calls = _capture_quantized_inputs(monkeypatch)
    with torch.no_grad():
        logp_padded = Actor(model)(seq, mask, R)
        n = len(calls)
        logp_packed = Actor(model, packing=True)(seq, mask, R)
    padded_calls, packed_calls = calls[:n], calls[n:]
    assert n > 0 and len(packed_calls) == n
    rows = mask.bool().flatten().nonzero().squeeze(1)
    for i, (a, b) in enumerate(zip(padded_calls, packed_calls)):
        assert torch.equal(b.data.view(torch.uint8), a.data[rows].view(torch.uint8)), f"FP8 linear input #{i}: bytes differ"
        assert torch.equal(b.scale, a.scale[rows]), f"FP8 linear input #{i}: scales differ"
    resp = torch.zeros_like(logp_padded, dtype=torch.bool)
    resp[pack_batch(seq, mask, R).rows, pack_batch(seq, mask, R).cols] = True
    assert torch.equal(logp_packed[resp], logp_padded[resp])
    assert torch.all(logp_packed[~resp] == 0)


def test_packed_backward_gives_the_same_dgrad_bytes(tiny_path):
    """Backward through the FP8 flow: grad_output is quantized 1x128 per token for DGrad, so the
    gradient reaching the embeddings is bit-identical at every real token. (WGrad's operands are
    grouped 128x1 along tokens: which tokens share a group depends on the batch layout, as it does
    for any change of micro-batch; weight gradients then agree to FP8 resolution, not bytes.)"""
    recipe = get_recipe("jet_fp8")
    seq, mask, R = _padded_batch([4, 2, 6], [5, 3, 2], vocab=128)
    amask = torch.zeros(seq.shape[0], R, dtype=torch.bool)
    for i, r in enumerate([5, 3, 2]):
        amask[i, :r] = True
    grads = []
    for packing in (False, True):
        model = load_causal_lm(str(tiny_path), torch.float32, "jetrl_invariant")
        convert_to_fp8(model, recipe, side="train")
        box = []
        model.get_input_embeddings().register_forward_hook(lambda m, i, out: [out.register_hook(box.append), None][1])
        logp = Actor(model, packing=packing)(seq, mask, R)
        logp[amask].sum().backward()
        grads.append(box[0])
    rows = mask.bool()
    assert torch.equal(grads[1][0], grads[0][rows])


def test_packed_training_step_matches_unpacked(tiny_path):
    """Loss and weight gradients agree between layouts (bf16 recipe, fp32 weights, sdpa: float32
    kernels whose reduction order depends on the matrix shapes, so agreement to float32 round-off:
    |diff| <= K * 2^-24 * sum|terms|, bounded here by 1e-4 of the gradient's largest entry)."""
    seq, mask, R = _padded_batch([4, 2, 6], [5, 3, 2], vocab=128)
    amask = torch.zeros(seq.shape[0], R, dtype=torch.bool)
    for i, r in enumerate([5, 3, 2]):
        amask[i, :r] = True
    grads = []
    for packing in (False, True):
        model = load_causal_lm(str(tiny_path), torch.float32, "sdpa")
        logp, ent = Actor(model, packing=packing)(seq, mask, R, return_entropy=True)
        (logp[amask].sum() + 0.1 * ent[amask].sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        ref = grads[0][name]
        assert (grads[1][name] - ref).abs().max() <= 1e-4 * ref.abs().max(), name


def test_packed_critic_values_match_unpacked(tiny_path):
    seq, mask, R = _padded_batch([4, 2, 6], [5, 3, 2], vocab=128)
    critic = Critic.from_pretrained(str(tiny_path), torch.float32, "jetrl_invariant")
    convert_to_fp8(critic, get_recipe("jet_fp8"), side="train")
    torch.nn.init.normal_(critic.score.weight)
    with torch.no_grad():
        hidden = []
        critic.score.register_forward_pre_hook(lambda m, args: hidden.append(args[0]))
        v_pad = critic(seq, mask, R)
        critic.packing = True
        v_pack = critic(seq, mask, R)
    packed = pack_batch(seq, mask, R)
    # The backbone's hidden states are identical; the fp32 value head (a K-term dot product per token,
    # batched in two shapes) then agrees within twice its worst-case rounding bound.
    pad_rows = hidden[0][:, -R - 1 : -1][packed.rows, packed.cols]
    assert torch.equal(hidden[1], pad_rows)
    bound = 2 * matmul_bound(hidden[1], critic.score.weight.detach().t()).squeeze(-1)
    assert_within(v_pack[packed.rows, packed.cols], v_pad[packed.rows, packed.cols], bound, "packed vs padded values")
