"""The bitwise mode's vLLM layers (jetrl_precision.integrations.vllm_bitwise) on the installed vLLM (CPU here).

The plugin's replacement classes are process-wide, so outside a bitwise engine they must be vLLM's own: same forward
dispatch, same outputs, same registry name for `custom_ops` flags. In a bitwise engine (a `jetrl_fp8` quant config
with bitwise=True being built) they switch to the opaque ops, and the quant config hands out the invariant GEMM
methods for high-precision linears and lm_head.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from transformers import LlamaConfig  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.custom_op import op_registry_oot  # noqa: E402
from vllm.model_executor.layers.activation import SiluAndMul  # noqa: E402
from vllm.model_executor.layers.layernorm import RMSNorm  # noqa: E402
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod  # noqa: E402
from vllm.model_executor.layers.rotary_embedding import get_rope  # noqa: E402
from vllm.model_executor.layers.rotary_embedding.llama3_rope import Llama3RotaryEmbedding  # noqa: E402
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding  # noqa: E402

from precision_testutil import assert_same_bits, outlier_data  # noqa: E402
from jetrl_precision.batch_invariant import engine_ops  # noqa: E402
from jetrl_precision.integrations import vllm_bitwise, vllm_plugin  # noqa: E402
from jetrl_precision.integrations.vllm_quant import JetFp8Config  # noqa: E402
from jetrl_precision.recipe import RecipeError, get_recipe  # noqa: E402

LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert vllm_plugin.register()
    assert all(op_registry_oot.get(n) is c for n, c in vllm_bitwise.OOT_LAYERS.items())


def _build(fn, *, bitwise: bool, hf_config=None, monkeypatch=None):
    """Call fn under a vLLM config whose quant config is (or is not) a bitwise jetrl_fp8 one."""
    settings = vllm_plugin.JetFp8Settings(get_recipe("bf16"), bitwise=bitwise)
    fake = SimpleNamespace(quant_config=JetFp8Config(settings), model_config=SimpleNamespace(hf_text_config=hf_config, dtype=torch.bfloat16))
    monkeypatch.setattr(vllm_bitwise, "_current_vllm_config", lambda: fake)
    with set_current_vllm_config(VllmConfig()):
        return fn()


def _without_oot(name: str, fn):
    saved = op_registry_oot.pop(name)
    try:
        return fn()
    finally:
        op_registry_oot[name] = saved


def test_outside_bitwise_engines_the_layers_are_vllms(monkeypatch):
    g = torch.Generator().manual_seed(0)
    x = outlier_data((7, 64), generator=g)
    res = outlier_data((7, 64), generator=g)
    cases = {
        "RMSNorm": (lambda: RMSNorm(64, eps=1e-5), lambda m: m(x.clone(), res.clone())),
        "SiluAndMul": (lambda: SiluAndMul(), lambda m: m(x.clone())),
        "RotaryEmbedding": (
            lambda: get_rope(16, 4096, True, {"rope_theta": 10000.0, "rope_type": "default"}, torch.float32),
            lambda m: m(torch.arange(7) * 500, x.clone(), res.clone()),
        ),
    }
    for name, (build, call) in cases.items():
        ours = _build(build, bitwise=False, monkeypatch=monkeypatch)
        assert type(ours) is vllm_bitwise.OOT_LAYERS[name] and ours.jetrl_bitwise is False
        own = _build(lambda: _without_oot(name, build), bitwise=False, monkeypatch=monkeypatch)
        assert type(own) is type(ours).__mro__[1 if name != "RotaryEmbedding" else 2]
        assert type(ours).name == type(own).name  # custom_ops flags ("+rms_norm") still address it
        a, b = call(ours), call(own)
        for t, u in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert_same_bits(t, u, f"{name} outside a bitwise engine")
        vllm_bitwise_rope_cache_clear()


def vllm_bitwise_rope_cache_clear():
    from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT

    _ROPE_DICT.clear()


def test_in_a_bitwise_engine_the_layers_run_the_trainers_ops(monkeypatch):
    cfg = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256, num_hidden_layers=1,
                      vocab_size=64, max_position_embeddings=8192, rope_theta=500000.0, rope_scaling=LLAMA3)
    vllm_bitwise_rope_cache_clear()
    rope = _build(lambda: get_rope(32, 8192, True, {"rope_theta": 500000.0, **LLAMA3}, torch.bfloat16), bitwise=True,
                  hf_config=cfg, monkeypatch=monkeypatch)
    assert isinstance(rope, Llama3RotaryEmbedding) and type(rope) is vllm_bitwise.BitwiseLlama3RotaryEmbedding and rope.jetrl_bitwise
    g = torch.Generator().manual_seed(1)
    pos = torch.tensor([0, 3, 1000, 8191])
    q, k = outlier_data((4, 128), generator=g).to(torch.bfloat16), outlier_data((4, 64), generator=g).to(torch.bfloat16)
    inv_freq, scaling = engine_ops.hf_rope_inv_freq(cfg)
    for got, want in zip(rope(pos, q, k), engine_ops.rotary_reference(pos, q, k, inv_freq, scaling, 32)):
        assert_same_bits(got, want, "bitwise llama3 rotary layer")
    vllm_bitwise_rope_cache_clear()

    act = _build(lambda: SiluAndMul(), bitwise=True, monkeypatch=monkeypatch)
    x = outlier_data((4, 2 * 96), generator=g).to(torch.bfloat16)
    assert act.jetrl_bitwise
    assert_same_bits(act(x), engine_ops.silu_and_mul_reference(x), "bitwise SiluAndMul")

    norm = _build(lambda: RMSNorm(128, eps=1e-5), bitwise=True, monkeypatch=monkeypatch)
    assert norm.jetrl_bitwise and norm._forward_method == norm._forward_bitwise  # the Triton kernel: GPU test


def test_bitwise_quant_config_hands_out_the_invariant_gemms():
    def bare(cls):
        return torch.nn.Module.__new__(cls)  # isinstance is all get_quant_method reads

    from vllm.model_executor.layers.linear import RowParallelLinear

    for recipe, bitwise in (("bf16", True), ("bf16", False), ("jet_fp8", True)):
        qc = JetFp8Config(vllm_plugin.JetFp8Settings(get_recipe(recipe), bitwise=bitwise))
        lin = qc.get_quant_method(bare(RowParallelLinear), "model.layers.0.mlp.down_proj")
        head = qc.get_quant_method(bare(ParallelLMHead), "lm_head")
        emb = qc.get_quant_method(bare(VocabParallelEmbedding), "model.embed_tokens")
        if not bitwise:
            assert type(lin) is UnquantizedLinearMethod and head is None and emb is None
        elif recipe == "bf16":
            assert type(lin) is vllm_bitwise.InvariantLinearMethod
        else:
            assert type(lin).__name__ == "JetFp8LinearMethod" and lin.settings.gemm_backend == "triton_invariant"
        if bitwise:
            assert type(head) is vllm_bitwise.InvariantEmbeddingMethod and type(emb) is vllm_bitwise.InvariantEmbeddingMethod
    assert issubclass(RowParallelLinear, LinearBase)


def test_bitwise_settings_travel_and_refuse_other_gemms():
    s = vllm_plugin.JetFp8Settings(get_recipe("jet_fp8"), bitwise=True)
    assert vllm_plugin.JetFp8Settings.from_dict(s.to_dict()) == s
    assert vllm_plugin.JetFp8Settings.from_dict({"recipe": "jet_fp8"}).bitwise is False
    import dataclasses

    with pytest.raises(RecipeError, match="triton_invariant") as e:
        vllm_plugin.JetFp8Settings(dataclasses.replace(get_recipe("jet_fp8"), gemm_backend="torch"), bitwise=True)
    assert "\n" not in str(e.value)


def test_bitwise_engine_kwargs_carry_the_switch_and_the_attention():
    import importlib.util

    recipe = get_recipe("jet_fp8")
    plain = vllm_plugin.engine_kwargs(recipe)
    assert plain["hf_overrides"]["quantization_config"]["bitwise"] is False
    if importlib.util.find_spec("jetrl_precision.integrations.vllm_bitwise_attention") is None:
        from jetrl_precision.batch_invariant import BitwiseUnavailable

        with pytest.raises(BitwiseUnavailable, match="vllm_bitwise_attention"):
            vllm_plugin.engine_kwargs(recipe, bitwise=True)
        return
    from jetrl_precision.integrations.vllm_bitwise_attention import bitwise_attention_engine_kwargs

    kw = vllm_plugin.engine_kwargs(recipe, bitwise=True)
    assert kw["hf_overrides"]["quantization_config"]["bitwise"] is True
    assert all(kw[k] == v for k, v in bitwise_attention_engine_kwargs().items())


def test_the_bitwise_sampler_replaces_the_v1_samplers_logprobs_only():
    from vllm.v1.sample.sampler import Sampler

    from jetrl_precision.batch_invariant import BitwiseUnavailable
    from jetrl_precision.kernels import triton_available

    with pytest.raises(BitwiseUnavailable, match="not vLLM's V1 or V2 .* VLLM_USE_V2_MODEL_RUNNER=0"):
        vllm_bitwise.install_bitwise_sampler(SimpleNamespace(model_runner=SimpleNamespace(sampler=object())))
    with pytest.raises(BitwiseUnavailable, match="raw_logprobs"):
        vllm_bitwise.install_bitwise_sampler(SimpleNamespace(model_runner=SimpleNamespace(sampler=Sampler(logprobs_mode="processed_logprobs"))))
    sampler = Sampler(logprobs_mode="raw_logprobs")
    worker = SimpleNamespace(model_runner=SimpleNamespace(sampler=sampler))
    if not triton_available():  # the CI venv: the kernel cannot run, and the install says so
        with pytest.raises(BitwiseUnavailable, match="Triton is not installed"):
            vllm_bitwise.install_bitwise_sampler(worker)
        return
    assert vllm_bitwise.install_bitwise_sampler(worker) == "Sampler/v1"
    assert sampler.compute_logprobs is not Sampler.compute_logprobs and sampler.jetrl_temperature == 1.0
    vllm_bitwise.set_bitwise_temperature(worker, 0.7)
    assert sampler.jetrl_temperature == 0.7
    assert Sampler(logprobs_mode="raw_logprobs").compute_logprobs is Sampler.compute_logprobs  # other samplers untouched


def test_the_bitwise_sampler_replaces_the_v2_runners_token_logprobs(monkeypatch):
    """The V2 model runner's sampler reads its log-probs from `sample.logprob.compute_token_logprobs`: the install
    replaces it in the worker's process with the trainer's log-softmax at the requested ids (the sampled token
    first), over the raw logits, divided by the temperature set later."""
    logprob = pytest.importorskip("vllm.v1.worker.gpu.sample.logprob")
    from vllm.v1.worker.gpu.sample.sampler import Sampler as V2Sampler

    from jetrl_precision.batch_invariant import BitwiseUnavailable
    from jetrl_precision.kernels import triton_available

    monkeypatch.setattr(logprob, "compute_token_logprobs", logprob.compute_token_logprobs)  # restored after the test
    sampler = V2Sampler.__new__(V2Sampler)  # the constructor wants the runner's request state; install reads only this
    sampler.logprobs_mode = "processed_logprobs"
    worker = SimpleNamespace(model_runner=SimpleNamespace(sampler=sampler))
    with pytest.raises(BitwiseUnavailable, match="raw_logprobs"):
        vllm_bitwise.install_bitwise_sampler(worker)
    sampler.logprobs_mode = "raw_logprobs"
    if not triton_available():
        with pytest.raises(BitwiseUnavailable, match="Triton is not installed"):
            vllm_bitwise.install_bitwise_sampler(worker)
        return
    original = logprob.compute_token_logprobs
    assert vllm_bitwise.install_bitwise_sampler(worker) == "Sampler/v2"
    assert logprob.compute_token_logprobs is not original
    vllm_bitwise.set_bitwise_temperature(worker, 0.7)
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 300, generator=g) * 3).to(torch.bfloat16)
    logits[:, 7] = 40.0  # an outlier column
    ids = torch.randint(0, 300, (5, 3), generator=g)
    got = logprob.compute_token_logprobs(logits, ids)
    want = torch.log_softmax(logits.double() / 0.7, -1).gather(-1, ids)
    assert got.dtype == torch.float32 and got.shape == (5, 3)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)


def test_a_bitwise_engine_reports_the_numerics_it_built(monkeypatch):
    """The rollout precision graph's numerics come from the modules the engine instantiated: batch-invariant only
    when every norm, rotary, activation, linear, lm_head, attention layer and the sampler is the trainer's."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    def bare(cls, method):  # isinstance and quant_method are all the report reads
        m = torch.nn.Module.__new__(cls)
        torch.nn.Module.__init__(m)
        m.quant_method = method
        return m

    def layers():
        model = torch.nn.Module()
        model.norm, model.act = RMSNorm(64, eps=1e-5), SiluAndMul()
        model.rope = get_rope(16, 4096, True, {"rope_theta": 10000.0, "rope_type": "default"}, torch.bfloat16)
        return model

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, num_hidden_layers=1,
                      vocab_size=64, max_position_embeddings=4096, rope_theta=10000.0)
    vllm_bitwise_rope_cache_clear()
    model = _build(layers, bitwise=True, hf_config=cfg, monkeypatch=monkeypatch)
    model.down_proj = bare(RowParallelLinear, vllm_bitwise.InvariantLinearMethod())
    model.lm_head = bare(ParallelLMHead, vllm_bitwise.InvariantEmbeddingMethod())
    worker = SimpleNamespace(model_runner=SimpleNamespace(sampler=SimpleNamespace(jetrl_temperature=1.0)))
    real_attention_check = vllm_bitwise._attention_not_bitwise
    monkeypatch.setattr(vllm_bitwise, "_attention_not_bitwise", lambda m: None)  # the backend's own check: its tests
    assert vllm_bitwise.engine_numerics(worker, model) == ("batch_invariant", vllm_bitwise.INVARIANT_DETAIL.format(fp8="-"))

    # one vLLM op of each kind left in: each is named, and the engine is not batch-invariant
    vllm_bitwise_rope_cache_clear()
    model.plain = _build(lambda: _without_oot("RMSNorm", lambda: RMSNorm(64, eps=1e-5)), bitwise=True, monkeypatch=monkeypatch)
    model.plain_act = _build(lambda: _without_oot("SiluAndMul", SiluAndMul), bitwise=True, monkeypatch=monkeypatch)
    model.plain_rope = _build(lambda: _without_oot("RotaryEmbedding", lambda: get_rope(
        16, 2048, True, {"rope_theta": 10000.0, "rope_type": "default"}, torch.bfloat16)), bitwise=True, monkeypatch=monkeypatch)
    model.up_proj = bare(RowParallelLinear, UnquantizedLinearMethod())
    model.experts = torch.nn.Module()  # what FusedMoE holds: stacked expert matrices, multiplied by vLLM's kernels
    model.experts.w13_weight = torch.nn.Parameter(torch.ones(2, 8, 4), requires_grad=False)
    worker.model_runner.sampler = SimpleNamespace()
    monkeypatch.setattr(vllm_bitwise, "_attention_not_bitwise", real_attention_check)
    mode, detail = vllm_bitwise.engine_numerics(worker, model)
    assert mode == "ordinary"
    for part in ("1 vLLM norm(s) (e.g. plain)", "1 vLLM activation(s) (e.g. plain_act)", "1 vLLM rotary embedding(s) (e.g. plain_rope)",
                 "1 linear(s) outside the invariant GEMMs (e.g. up_proj: UnquantizedLinearMethod)",
                 "1 module(s) with matrix products of their own (MoE experts?) (e.g. experts: Module)",
                 "log-probs from SimpleNamespace (install_bitwise_sampler has not run)", "attention"):
        assert part in detail, (part, detail)
    vllm_bitwise_rope_cache_clear()
