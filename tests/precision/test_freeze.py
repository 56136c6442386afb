"""Frozen FP8 layers (`Fp8Linear.freeze`, `freeze_fp8_weights`): an inference-only model keeps Q(W) and nothing else.

What must hold, on CPU (the emulated GEMM makes every byte of the forward visible):
- a frozen model's forward is the unfrozen model's, bit for bit, stacked projection groups included (freezing undoes
  them), and its FP8 buffers are the bytes the layers cached (what a weight sync would have sent);
- the high-precision weights are gone: no longer parameters, `weight` a meta tensor with the shape and dtype, and
  the layer holds one byte per weight plus its scales;
- moves keep the format: `.to(dtype)` / `.half()` never cast the e4m3 bytes or the fp32 scales, a device move
  takes them along and the forward then reads the moved ones;
- what a frozen layer cannot do is refused in one line: training through it, a weight install, saving a state
  dict (it would miss the weights), freezing a layer that still requires grad or runs its forward in BF16.
The GPU side (same bytes with the Triton quantizer and cuBLASLt, memory freed) is tests/gpu/test_freeze_gpu.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from precision_testutil import outlier_data, tiny_causal_lm

from jetrl_precision import FrozenWeights, convert_to_fp8, fp8_linears, freeze_fp8_weights, fuse_projections
from jetrl_precision.grouped import projection_groups


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def _model(dtype=torch.bfloat16):
    """Head dim 128 and one KV head: q/k/v (128+128+128 rows) and gate/up stack, as at 8B."""
    model = tiny_causal_lm(hidden=256, intermediate=384, heads=2, kv_heads=1, layers=2, vocab=320, dtype=dtype)
    convert_to_fp8(model, "jet_fp8")
    return model.requires_grad_(False).eval()


def _ids(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 320, (3, 40), generator=g)


def test_frozen_forward_is_the_cached_forward_bit_for_bit():
    model = _model()
    assert len(projection_groups(model)) == 4  # q/k/v and gate/up in both layers: the stacked path is what we freeze
    unfrozen = copy.deepcopy(model)
    ids = _ids()
    with torch.no_grad():
        want = unfrozen(ids).logits
    cached = {name: m.quantized_weight() for name, m in fp8_linears(unfrozen).items()}
    report = freeze_fp8_weights(model)
    assert isinstance(report, FrozenWeights) and report.layers == 14
    assert projection_groups(model) == [] and len(projection_groups(unfrozen)) == 4
    with torch.no_grad():
        got = model(ids).logits
    assert torch.equal(_bits(got), _bits(want))
    for name, m in fp8_linears(model).items():
        assert m.frozen and torch.equal(_bits(m.weight_fp8), _bits(cached[name].data)), name
        assert torch.equal(m.weight_fp8_scale, cached[name].scale) and m.quantized_weight().data is m.weight_fp8
    # one layer on inputs with outliers, 2-D and 3-D
    frozen, live = model.model.layers[0].mlp.down_proj, unfrozen.model.layers[0].mlp.down_proj
    x = outlier_data((2, 17, frozen.in_features), dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(_bits(frozen(x)), _bits(live(x)))
        assert torch.equal(_bits(frozen(x[0])), _bits(live(x[0])))


def test_freezing_drops_the_high_precision_weights():
    model = _model()
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    shapes = {name: (tuple(m.weight.shape), m.weight.dtype) for name, m in fp8_linears(model).items()}
    report = freeze_fp8_weights(model)
    after = sum(p.numel() * p.element_size() for p in model.parameters())
    fp8_elems = sum(m.in_features * m.out_features for m in fp8_linears(model).values())
    assert report.freed_bytes == 2 * fp8_elems == before - after  # bf16: two bytes per weight, all of them gone
    scales = sum(m.weight_fp8_scale.numel() for m in fp8_linears(model).values())
    assert report.kept_bytes == fp8_elems + 4 * scales
    for name, m in fp8_linears(model).items():
        assert "weight" not in dict(m.named_parameters())
        assert m.weight.device.type == "meta" and (tuple(m.weight.shape), m.weight.dtype) == shapes[name]
        assert m.weight_device.type == "cpu" and "frozen" in repr(m)
    again = freeze_fp8_weights(model)  # idempotent
    assert again.layers == 0 and again.freed_bytes == 0


def test_moves_keep_the_fp8_format_and_the_forward():
    model = _model()
    freeze_fp8_weights(model)
    ids = _ids(1)
    lin = model.model.layers[1].self_attn.o_proj
    data, scale = lin.weight_fp8, lin.weight_fp8_scale
    model.float()
    model.half()
    model.to(torch.bfloat16)
    assert lin.weight_fp8 is data and lin.weight_fp8_scale is scale  # same device: untouched, never cast
    assert lin.weight_fp8.dtype == torch.float8_e4m3fn and lin.weight_fp8_scale.dtype == torch.float32
    # float -> bfloat16 round trips the other parameters exactly; the rotary table was float32 before and is
    # bfloat16 now, so compare against an unfrozen model given the same round trip
    ref = _model()
    ref.float()
    ref.to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(_bits(model(ids).logits), _bits(ref(ids).logits))
    # a device move takes the FP8 weight along, and the forward reads the moved tensors
    lin.to("meta")
    assert lin.weight_fp8.device.type == "meta" and lin.weight_fp8.dtype == torch.float8_e4m3fn
    assert lin.quantized_weight().data is lin.weight_fp8 and lin.quantized_weight().scale is lin.weight_fp8_scale
    assert lin.weight_device.type == "meta"


def test_what_a_frozen_layer_cannot_do_is_refused_in_one_line():
    model = _model()
    lin = model.model.layers[0].mlp.down_proj
    with pytest.raises(ValueError, match="stacked projection group; freeze through freeze_fp8_weights"):
        model.model.layers[0].self_attn.q_proj.freeze()
    freeze_fp8_weights(model)
    x = outlier_data((5, lin.in_features), dtype=torch.bfloat16).requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"frozen \(forward only\).*torch.no_grad\(\)"):
        lin(x)
    with pytest.raises(ValueError, match="frozen"):
        lin.install_quantized_weight(None)
    with pytest.raises(RuntimeError, match="frozen.*no high-precision weight to save"):
        model.state_dict()
    assert fuse_projections(model) == 0  # frozen layers never regroup
    assert "frozen" in model.model.layers[0].self_attn.q_proj._group_skipped

    training = _model().requires_grad_(True)
    with pytest.raises(ValueError, match=r"still require grad .*requires_grad_\(False\) first"):
        freeze_fp8_weights(training)
    assert not any(m.frozen for m in fp8_linears(training).values())  # refused before touching any layer
    bf16_forward = tiny_causal_lm(hidden=256, intermediate=384, heads=2, kv_heads=1, layers=1, vocab=320)
    convert_to_fp8(bf16_forward, "jet_fp8")
    layer = next(iter(fp8_linears(bf16_forward).values()))
    layer.requires_grad_(False)
    layer.fprop = type(layer.fprop)()  # a BF16 forward: nothing to freeze to
    with pytest.raises(ValueError, match="high-precision weight; nothing to freeze to"):
        layer.freeze()
