"""Frozen FP8 layers (`freeze_fp8_weights`) on the GPU: the reference policy's memory without its BF16 weights.

A Llama-shaped model (head dim 128, so q/k/v and gate/up stack) in BF16, jet_fp8 on the default backend: frozen, its
forward gives the unfrozen (stacked, cached) model's logits bit for bit, the device memory drops by the BF16 weight
bytes, a model frozen from the CPU with `device="cuda"` holds the same bytes as one frozen on the GPU, and the
offloaded round trip (CPU -> GPU for the forward) gives the same logits. The CPU side is tests/precision/test_freeze.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from gpu_testutil import requires_cuda_reason
from jetrl_precision import convert_to_fp8, fp8_linears, freeze_fp8_weights
from jetrl_precision.grouped import projection_groups

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason)


def _model():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=3584, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    convert_to_fp8(model, "jet_fp8")
    return model.requires_grad_(False).eval()


def _cuda_tensors() -> dict[int, tuple]:
    """id -> (shape, dtype, bytes of its storage) of every CUDA tensor the garbage collector can see."""
    import gc

    out = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.is_cuda:
            out[id(o)] = (tuple(o.shape), str(o.dtype), o.untyped_storage().nbytes())
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_frozen_reference_forward_and_memory():
    cpu_copy = _model()
    model = copy.deepcopy(cpu_copy).cuda()
    assert projection_groups(model)
    ids = torch.randint(0, 4096, (4, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    torch.cuda.synchronize()
    alive_before = _cuda_tensors()
    before = torch.cuda.memory_allocated()
    report = freeze_fp8_weights(model)
    torch.cuda.empty_cache()
    after = torch.cuda.memory_allocated()
    # The BF16 weights and the FP8 caches the unfrozen forward built go; the FP8 weights stay. The frozen layers hold
    # more, smaller tensors than the stacked caches did (a scale per layer, not per group): the caching allocator
    # rounds each up to 512 bytes, so up to 512 bytes per kept tensor may go to rounding.
    if before - after < report.freed_bytes - 512 * 2 * report.layers:  # name what is still held: new tensors that are not the frozen weights
        import gc

        gc.collect()
        kept = {id(b) for m in fp8_linears(model).values() for b in (m.weight_fp8, m.weight_fp8_scale)}
        now = _cuda_tensors()
        new = [desc for i, desc in now.items() if i not in alive_before and i not in kept]
        fp8_left = [desc for i, desc in now.items() if i in alive_before and i not in kept and "float8" in desc[1]]
        pytest.fail(f"freed {before - after} bytes < {report}; after gc.collect(): {before - torch.cuda.memory_allocated()}; "
                    f"tensors made during freezing and still alive: {new[:8]}; FP8 tensors from before still alive: {fp8_left[:8]}")
    with torch.no_grad():
        got = model(ids).logits
    assert torch.equal(_bits(got), _bits(want))

    # frozen from the CPU, quantized on the GPU: the same bytes, kept on the CPU; then the offloaded forward
    offloaded = freeze_fp8_weights(cpu_copy, device="cuda")
    assert offloaded.layers == report.layers
    for (name, a), b in zip(fp8_linears(model).items(), fp8_linears(cpu_copy).values()):
        assert b.weight_fp8.device.type == "cpu"
        assert torch.equal(_bits(a.weight_fp8.cpu()), _bits(b.weight_fp8)), name
        assert torch.equal(a.weight_fp8_scale.cpu(), b.weight_fp8_scale), name
    cpu_copy.to("cuda")
    with torch.no_grad():
        moved = cpu_copy(ids).logits
    cpu_copy.cpu()
    assert torch.equal(_bits(moved), _bits(want))
