"""Stacked q/k/v and gate/up GEMMs (`jetrl_precision.grouped`) on the GPU, per FP8 GEMM backend.

Against the same weights run as separate layers: outputs and weight gradients agree to the GEMM's accumulation
(whether every bit agrees is recorded: the stacked GEMM's N may pick another cuBLASLt algorithm), the input gradient
is the stacked DGrad (as close to the float64 product of its FP8 operands as the separate layers' bf16 sum), the
members' cached FP8 weights are the separately quantized bytes in one buffer, and on a device whose probe accepts
the fused SwiGLU backward, the stacked gate/up GEMM reads its dY without a copy. The CPU side is
tests/precision/test_grouped.py; speed is gpu_bench.py's `layers` section.
"""

from __future__ import annotations

import copy
import gc
import json
import os

import pytest
import torch
from torch import nn

from gpu_testutil import fwd_bwd, outlier_data, requires_cuda_reason, sqnr_db
from jetrl_precision import convert_to_fp8, get_recipe, quantize_fp8
from jetrl_precision.gemm import available_backends
from jetrl_precision.grouped import Fp8LinearGroup, projection_groups
from jetrl_precision.swiglu import fuse_swiglu

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason)

if torch.cuda.is_available():  # the kernel modules import Triton, which CPU installs do not have
    from jetrl_precision.kernels import fused, swiglu_probe

_RESULTS: dict = {}


class _Block(nn.Module):
    """q/k/v of the normed input and a SwiGLU MLP (transformers' Llama layout, 8B's ratios at 1/4 width)."""

    def __init__(self, h: int = 1024, kv: int = 256, i: int = 3584) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(h, h, bias=False), nn.Linear(h, kv, bias=False), nn.Linear(h, kv, bias=False)
        self.mlp = _MLP(h, i)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.mlp(q + torch.cat([k, v], dim=-1).repeat(1, 1, q.shape[-1] // (2 * k.shape[-1])))


class _MLP(nn.Module):
    def __init__(self, h: int, i: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False), nn.Linear(i, h, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _backends() -> list[str]:
    have = available_backends("cuda") if torch.cuda.is_available() else {}
    return [b for b in ("torch", "deep_gemm") if b in have and have[b] is None] or ["torch"]


def _pair(backend: str):
    torch.manual_seed(0)
    base = _Block().to("cuda", torch.bfloat16)
    with torch.no_grad():
        for j, p in enumerate(base.parameters()):
            p.copy_(outlier_data(p.shape[0], p.shape[1], dtype=torch.float32, seed=j).view(p.shape) * 0.02)
    recipe = get_recipe("jet_fp8").replace(gemm_backend=backend)
    stacked, separate = copy.deepcopy(base), copy.deepcopy(base)
    convert_to_fp8(stacked, recipe)
    convert_to_fp8(separate, recipe, fuse_projections=False)
    fuse_swiglu(stacked, classes=[_MLP])
    fuse_swiglu(separate, classes=[_MLP])
    assert len(projection_groups(stacked)) == 2 and not projection_groups(separate)
    return stacked, separate


@pytest.mark.parametrize("backend", _backends())
def test_stacked_gemms_match_separate_layers(backend, monkeypatch):
    stacked, separate = _pair(backend)
    x = outlier_data(1100, 1024, seed=1).view(2, 550, 1024)  # 1100 tokens: a partial 128-row block in WGrad
    dy = outlier_data(1100, 1024, seed=2).view(2, 550, 1024)
    y0, dx0, g0 = fwd_bwd(separate, x, dy)
    views = []
    real = Fp8LinearGroup.stacked_grad

    def watched(self, grads):
        out = real(self, grads)
        views.append((self.label, out._base is not None))  # a view of the producer's buffer, or a torch.cat copy
        return out

    monkeypatch.setattr(Fp8LinearGroup, "stacked_grad", watched)
    y1, dx1, g1 = fwd_bwd(stacked, x, dy)
    row = {"output_bit_equal": bool(torch.equal(y0, y1)), "output_sqnr_db": round(sqnr_db(y1, y0), 1),
           "dgrad_sqnr_db": round(sqnr_db(dx1, dx0), 1),
           "weight_grad_sqnr_db_min": round(min(sqnr_db(g1[n], g0[n]) for n in g0), 1),
           "weight_grads_bit_equal": [n for n in g0 if torch.equal(g0[n], g1[n])], "dy_views": views}
    _RESULTS[backend] = row
    # Bits may differ (another algorithm for the wider N) and DGrad sums differently, which moves FP8 roundings of
    # dY upstream (CPU: 25-60 dB); a misread stacked weight or a wrong gradient block is near 0 dB.
    assert row["output_sqnr_db"] > 40 and row["weight_grad_sqnr_db_min"] > 20 and row["dgrad_sqnr_db"] > 20, row
    if swiglu_probe.fused_backward_ok(fused.silu_mul_backward, torch.device("cuda"), torch.bfloat16):
        assert ("gate_proj+up_proj", True) in views, views  # d(gate), d(up) written side by side: no copy
    assert ("q_proj+k_proj+v_proj", False) in views  # attention's gradients arrive apart: one cat


@pytest.mark.parametrize("backend", _backends())
def test_members_hold_their_own_bytes_in_one_buffer(backend):
    stacked, _ = _pair(backend)
    with torch.no_grad():
        stacked(outlier_data(256, 1024, seed=5).view(1, 256, 1024))
    for group in projection_groups(stacked):
        buf = group._wq_cache[1].data.untyped_storage().data_ptr()
        for m in group.members:
            wq = m.quantized_weight()
            want = quantize_fp8(m.weight.detach(), (128, 128))
            assert wq.data.untyped_storage().data_ptr() == buf
            assert torch.equal(wq.data.view(torch.uint8), want.data.view(torch.uint8)) and torch.equal(wq.scale, want.scale)


def test_a_deleted_model_returns_its_cuda_memory_at_once():
    # The parent holds each group and the members point at theirs weakly: no reference cycle, so `del` frees the
    # weights, their gradients and the stacked FP8 weights without waiting for Python's cycle collector.
    stacked, separate = _pair("torch")
    del separate
    out = fwd_bwd(stacked, outlier_data(512, 1024, seed=1).view(2, 256, 1024), outlier_data(512, 1024, seed=2).view(2, 256, 1024))
    del out
    held = sum(p.numel() * p.element_size() * (2 if p.grad is not None else 1) for p in stacked.parameters())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    gc.disable()
    try:
        del stacked
        freed = before - torch.cuda.memory_allocated()
    finally:
        gc.enable()
    assert freed >= held, (freed, held)


def test_record_results():
    out = os.environ.get("JETRL_RESULTS_DIR")
    if out and _RESULTS:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "grouped_gpu.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "backends": _RESULTS}, f, indent=1)
