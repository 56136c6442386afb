"""Batch-invariant numerics (jetrl_precision.batch_invariant): the float64 linear, the conversion, the
numerics the precision graph records and the refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from precision_testutil import gamma, outlier_data, tiny_causal_lm, unit_roundoff
from jetrl_precision import Fp8Linear, build_precision_graph, check_subgraph, convert_to_fp8, get_recipe
from jetrl_precision import batch_invariant as bi
from jetrl_precision.batch_invariant import attention as bi_attention, convert as bi_convert
from jetrl_precision.batch_invariant import BitwiseUnavailable, InvariantLinear, make_batch_invariant, numerics_of


def _invariant_model(recipe: str = "jet_fp8", dtype=torch.float32):
    from openrlhf.models.invariant_attention import register_invariant_attention

    model = tiny_causal_lm(dtype=dtype)
    model.set_attn_implementation(register_invariant_attention())
    return make_batch_invariant(convert_to_fp8(model, get_recipe(recipe), side="train"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_invariant_linear_rows_do_not_depend_on_the_batch(dtype):
    """Each row's bits are the same whether it runs alone, in a small batch or in a large one."""
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(576, 300, bias=True).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(outlier_data((300, 576), generator=g, dtype=dtype))
    layer = InvariantLinear.from_linear(lin)
    x = outlier_data((257, 576), generator=g, dtype=dtype)
    with torch.no_grad():
        full = layer(x)
        for rows in ([0], [5, 6, 7], list(range(100, 257))):
            assert torch.equal(layer(x[rows]), full[rows]), rows
        assert torch.equal(layer(x.view(257, 1, 576)).view(257, 300), full)  # a decode-shaped [B, 1, K] call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_invariant_linear_is_the_rounded_float64_product(dtype):
    """|y - (x W^T + b)| <= the one rounding to the dtype (u|y|/(1-u)) + the float64 sum's worst case (any order)."""
    g = torch.Generator().manual_seed(1)
    lin = nn.Linear(384, 64).to(dtype)
    layer = InvariantLinear.from_linear(lin)
    x = outlier_data((33, 384), generator=g, dtype=dtype)
    with torch.no_grad():
        y = layer(x).double()
    x64, w64, b64 = x.double(), lin.weight.double(), lin.bias.double()
    exact = x64 @ w64.t() + b64
    sum64 = gamma(385, torch.float64) * (x64.abs() @ w64.abs().t() + b64.abs())
    u = unit_roundoff(dtype)
    bound = u / (1 - u) * y.abs() + sum64 + 1e-300
    assert ((y - exact).abs() <= bound).all()


def test_invariant_linear_adopts_the_parameters_and_backpropagates():
    g = torch.Generator().manual_seed(2)
    lin = nn.Linear(256, 96)
    layer = InvariantLinear.from_linear(lin)
    assert layer.weight is lin.weight and layer.bias is lin.bias
    x = outlier_data((20, 256), generator=g).requires_grad_(True)
    gy = torch.randn(20, 96, generator=g)
    layer(x).backward(gy)
    # The backward is the ordinary fp32 one: compare against float64 with the matmul worst case.
    x64, w64, gy64 = x.detach().double(), lin.weight.detach().double(), gy.double()
    for got, exact, k, bound_terms in (
        (x.grad, gy64 @ w64, 96, gy64.abs() @ w64.abs()),
        (lin.weight.grad, gy64.t() @ x64, 20, gy64.abs().t() @ x64.abs()),
    ):
        assert ((got.double() - exact).abs() <= gamma(k) * bound_terms + 1e-300).all()
    assert torch.allclose(lin.bias.grad.double(), gy64.sum(0), rtol=0, atol=float(gamma(20) * gy64.abs().sum(0).max()))


@pytest.mark.parametrize("recipe", ["bf16", "jet_fp8"])
def test_make_batch_invariant_converts_every_ordinary_linear(recipe):
    model = _invariant_model(recipe)
    assert not [n for n, m in model.named_modules() if type(m) is nn.Linear]
    assert isinstance(model.lm_head, InvariantLinear)
    report = numerics_of(model)
    assert report.batch_invariant and report.mode == "batch_invariant"
    assert report.attention == "jetrl_invariant" and report.linear == "fp64"
    assert report.fp8_gemm == ("emulated" if recipe == "jet_fp8" else "-")


def test_numerics_of_names_what_is_not_batch_invariant():
    model = convert_to_fp8(tiny_causal_lm(), get_recipe("jet_fp8"))  # eager attention, ordinary lm_head
    report = numerics_of(model)
    assert not report.batch_invariant
    assert "attention eager" in report.detail() and "ordinary linear(s) (e.g. lm_head)" in report.detail()


def test_numerics_of_judges_the_device_the_model_will_run_on():
    """The trainer converts on the CPU before DeepSpeed moves the model: the report is for the device it names, and
    the FP8 backends are resolved there (a CUDA-only backend must not be resolved for the CPU the weights sit on)."""
    model = _invariant_model("jet_fp8")
    assert numerics_of(model).batch_invariant
    report = numerics_of(model, "cuda")
    assert not report.batch_invariant
    assert "attention jetrl_invariant on cuda" in report.detail() and "FP8 GEMM backend emulated on cuda" in report.detail()
    fp8 = next(m for m in model.modules() if isinstance(m, Fp8Linear))
    assert fp8.weight.device.type == "cpu" and fp8.backend_for(torch.device("cuda")) == "emulated"


def test_make_batch_invariant_refuses_an_ordinary_attention():
    with pytest.raises(BitwiseUnavailable, match="attention eager.*jetrl_invariant"):
        make_batch_invariant(convert_to_fp8(tiny_causal_lm(), get_recipe("jet_fp8")))


def test_make_batch_invariant_refuses_cuda_without_triton(monkeypatch):
    import jetrl_precision.kernels as kernels

    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    with pytest.raises(BitwiseUnavailable) as e:
        make_batch_invariant(tiny_causal_lm(), device="cuda")
    msg = str(e.value)
    assert "on cuda need the Triton kernels: Triton is not installed" in msg and "\n" not in msg
    with pytest.raises(BitwiseUnavailable, match="Triton kernels run on CUDA.*TRITON_INTERPRET"):
        monkeypatch.setattr(kernels, "triton_available", lambda: True)
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        make_batch_invariant(tiny_causal_lm(), kernels="triton")  # CPU model, no interpreter
    with pytest.raises(BitwiseUnavailable, match="on cuda the batch-invariant numerics are the Triton kernels"):
        make_batch_invariant(tiny_causal_lm(), device="cuda", kernels="fp64")


def test_make_batch_invariant_refuses_fp8_linears_on_cuda_without_the_invariant_gemm(monkeypatch):
    """The Triton path converts norms and attention; FP8 linears on CUDA need the triton_invariant GEMM, and the
    refusal names it, on one line."""
    monkeypatch.setattr(bi_convert, "triton_missing", lambda device: None)
    model = convert_to_fp8(tiny_causal_lm(), get_recipe("jet_fp8"))  # emulated on this CPU machine
    with pytest.raises(BitwiseUnavailable) as e:
        make_batch_invariant(model, device="cuda")
    msg = str(e.value)
    assert "\n" not in msg and "FP8 linears run the emulated GEMM" in msg and "--precision.gemm_backend triton_invariant" in msg
    # What it converted before refusing: every RMSNorm and the attention.
    assert model.config._attn_implementation == bi.TRITON_ATTENTION
    assert not bi_convert._ordinary_norms(model) and any(isinstance(m, bi.InvariantRMSNorm) for m in model.modules())
    assert model.model.norm.weight is not None


def test_make_batch_invariant_refuses_a_norm_without_a_kernel(monkeypatch):
    monkeypatch.setattr(bi_convert, "triton_missing", lambda device: None)

    class GemmaLikeRMSNorm(nn.Module):  # weight * (1 + x/rms): not the Llama formula
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(4))

    model = tiny_causal_lm()
    model.model.layers[0].input_layernorm = GemmaLikeRMSNorm()
    with pytest.raises(BitwiseUnavailable, match="no batch-invariant kernel for GemmaLikeRMSNorm"):
        make_batch_invariant(model, device="cuda")


def test_make_batch_invariant_refuses_soft_capped_attention_on_the_triton_kernels(monkeypatch):
    monkeypatch.setattr(bi_convert, "triton_missing", lambda device: None)
    model = tiny_causal_lm()
    model.config.attn_logit_softcapping = 50.0  # Gemma 2's
    with pytest.raises(BitwiseUnavailable, match=r"soft-capping \(attn_logit_softcapping=50.0"):
        make_batch_invariant(model, device="cuda")


def test_the_triton_attention_refuses_what_its_kernel_does_not_compute():
    q, k = torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    module = nn.Module()
    for kwargs, needle in (({"softcap": 50.0}, "soft-capping"), ({"sliding_window": 4}, "sliding window of 4"),
                           ({"s_aux": torch.zeros(2)}, "attention sinks")):
        with pytest.raises(ValueError, match=needle):
            bi_attention.triton_attention(module, q, k, k, None, 0.25, **kwargs)


def test_the_fp64_attention_soft_caps_as_transformers_eager_attention_does():
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64) * 4 for _ in range(3))
    module = nn.Module()
    module.num_key_value_groups, module.training = 1, False
    want, _ = eager_attention_forward(module, q, k, v, None, scaling=0.5, softcap=3.0)
    got, _ = bi_attention.fp64_attention(module, q, k, v, None, 0.5, softcap=3.0)
    plain, _ = bi_attention.fp64_attention(module, q, k, v, None, 0.5)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # transformers' softmax runs in float32
    assert (plain - want).abs().max() > 1e-2  # the cap matters at these scores


def test_graph_records_the_numerics_and_refuses_one_sided_invariance():
    jet = get_recipe("jet_fp8")
    train = build_precision_graph(_invariant_model(), jet, "train_fwd")
    assert train.meta["numerics"] == "batch_invariant"
    assert "attention=jetrl_invariant linear=fp64 fp8_gemm=emulated" in train.meta["numerics_detail"]
    assert {e.attrs.backend for e in train.edges_into("lm_head").values()} == {"fp64"}
    rollout_ok = build_precision_graph(_invariant_model(), jet, "rollout")
    assert check_subgraph(rollout_ok, train) == []
    ordinary = build_precision_graph(convert_to_fp8(tiny_causal_lm(), jet, side="rollout"), jet, "rollout")
    assert ordinary.meta["numerics"] == "ordinary"
    violations = check_subgraph(ordinary, train)
    assert [v.kind for v in violations] == ["numerics"]
    assert "batch_invariant" in violations[0].expected and "attention eager" in violations[0].found
    # Graphs from engines that do not report numerics (older plugins) count as ordinary.
    legacy = build_precision_graph(convert_to_fp8(tiny_causal_lm(), jet, side="rollout"), jet, "rollout")
    legacy.meta.pop("numerics")
    ordinary_train = build_precision_graph(convert_to_fp8(tiny_causal_lm(), jet), jet, "train_fwd")
    assert check_subgraph(legacy, ordinary_train) == []
    assert [v.kind for v in check_subgraph(legacy, train)] == ["numerics"]


def test_triton_attention_reads_padding_packing_and_cached_calls_into_segments():
    """The transformers wrapper's layout logic (pure torch: runs without Triton): each call's per-sequence rows,
    recomputed for every new or modified mask (never a stale layout from a freed tensor), bad masks refused."""
    cpu = torch.device("cpu")
    rows = lambda s: list(zip(s.q_start.tolist(), s.q_len.tolist(), s.k_start.tolist(), s.k_len.tolist()))  # noqa: E731
    m = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    assert rows(bi_attention._segments(m, None, 2, 4, 4, cpu)) == [(1, 3, 1, 3), (4, 4, 4, 4)]  # left padding
    m = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0]])
    assert rows(bi_attention._segments(m, None, 2, 4, 4, cpu)) == [(0, 2, 0, 2), (5, 2, 5, 2)]  # right / both sides
    m[0, 2] = 1  # modified in place: read again
    assert rows(bi_attention._segments(m, None, 2, 4, 4, cpu))[0] == (0, 3, 0, 3)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])  # packed: position ids restart
    assert rows(bi_attention._segments(None, pos, 1, 6, 6, cpu)) == [(0, 3, 0, 3), (3, 2, 3, 2), (5, 1, 5, 1)]
    decode = torch.tensor([[0, 1, 1], [1, 1, 1]])  # one new token per row against a left-padded cache
    seg = bi_attention._segments(decode, None, 2, 1, 3, cpu)
    assert rows(seg) == [(0, 1, 1, 2), (1, 1, 3, 3)] and seg.max_q_len == 1
    allowed, real = bi_attention._segment_mask(seg, 2, 1, 3, cpu)
    assert allowed[:, 0, 0].tolist() == [[False, True, True], [True, True, True]] and real.all()
    allowed, real = bi_attention._segment_mask(bi_attention._segments(torch.tensor([[0, 1, 1]]), None, 1, 3, 3, cpu), 1, 3, 3, cpu)
    assert real.tolist() == [[False, True, True]]
    assert allowed[0, 0].tolist() == [[False] * 3, [False, True, False], [False, True, True]]  # causal within the run
    with pytest.raises(ValueError, match="row 0 of the padding mask has 2 runs"):
        bi_attention._segments(torch.tensor([[1, 0, 1]]), None, 1, 3, 3, cpu)
    with pytest.raises(ValueError, match="needs left padding only"):
        bi_attention._segments(torch.tensor([[1, 1, 0]]), None, 1, 1, 3, cpu)
