"""--precision.bitwise: the transformers engine's log-probs equal the trainer's recompute bit for bit, the
trainer then skips the recompute on steps a sample check proves it, and falls back loudly when it does not."""

from __future__ import annotations

import importlib.util
import logging
import math

import pytest
import torch

from _rl_helpers import grpo_args
from jetrl_precision import convert_to_fp8, get_recipe
from jetrl_precision.batch_invariant import BitwiseUnavailable, make_batch_invariant
from openrlhf.config import ConfigError, parse_config
from openrlhf.models.actor import Actor, load_causal_lm
from openrlhf.trainer.engines.base import RolloutEngine, RolloutSample, SamplingConfig
from openrlhf.trainer.engines.factory import build_engine, engine_kind
from openrlhf.trainer.engines.hf_engine import HFEngine
from openrlhf.trainer.ppo_utils.bitwise import EngineLogprobProof
from openrlhf.trainer.ppo_utils.experience_maker import sample_after_sync, samples_to_tensors
from openrlhf.trainer.preflight import preflight_errors
from openrlhf.utils.tiny_model import TinyModelSpec, build_tiny_model


@pytest.fixture(scope="module")
def peaky(tmp_path_factory):
    # Wide init: peaky next-token distributions, where precision differences show in logprobs.
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec(initializer_range=0.1, seed=3))


def _cfg(*extra: str):
    return parse_config(["--actor.model_name_or_path", "m", "--data.prompt_dataset", "d.jsonl", *extra], exit_on_error=False)


# ---- the numerics: decode == full forward ------------------------------------------------------------------
@pytest.mark.parametrize("recipe", ["bf16", "jet_fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_engine_logprobs_are_the_trainers_bit_for_bit(peaky, recipe, dtype):
    """KV-cached decoding in batches of 7 vs the trainer's padded and packed full forwards: every sampled
    token's log-prob is identical."""
    r = get_recipe(recipe)
    trainer = make_batch_invariant(convert_to_fp8(load_causal_lm(str(peaky), dtype, "jetrl_invariant"), r, side="train")).eval()
    engine = HFEngine(str(peaky), r, dtype=dtype, attn_implementation="jetrl_invariant", batch_invariant=True, generate_batch_size=7)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 100, (int(n),), generator=g).tolist() for n in torch.randint(3, 12, (16,), generator=g)]
    exp = sample_after_sync(trainer, engine, r, prompts, SamplingConfig(max_new_tokens=24, temperature=0.9, n=2, seed=1), 0)
    mask = exp.action_mask
    assert mask.sum() > 500
    for packing in (False, True):
        with torch.no_grad():
            lp = Actor(trainer, packing=packing)(exp.sequences, exp.attention_mask, exp.num_actions, temperature=0.9).float()
        assert torch.equal(lp[mask], exp.rollout_logprobs[mask]), f"packing={packing}"
    # The comparison sees the engine's own numbers: an ordinary engine in the other dtype differs on most tokens, on
    # any CPU. (Whether ordinary numerics in one dtype differ is up to the CPU's kernels: on most tokens with AVX-512
    # or AVX2, on none for jet_fp8 in bf16 with torch's scalar kernels; so that is not asserted.)
    other = sample_after_sync(trainer, HFEngine(str(peaky), r, dtype=torch.bfloat16 if dtype == torch.float32 else torch.float32),
                              r, prompts, SamplingConfig(max_new_tokens=24, temperature=0.9, n=2, seed=1), 0)
    with torch.no_grad():
        lp = Actor(trainer)(other.sequences, other.attention_mask, other.num_actions, temperature=0.9).float()
    m = other.action_mask
    assert (lp[m] != other.rollout_logprobs[m]).float().mean() > 0.5


# ---- the proof ---------------------------------------------------------------------------------------------
def _experience(rows: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(rows):
        n = int(torch.randint(1, 9, (1,), generator=g))
        lps = (-torch.rand(n, generator=g) * 5).tolist()
        samples.append(RolloutSample([1, 2, 3], torch.randint(4, 50, (n,), generator=g).tolist(), lps))
    return samples_to_tensors(samples, 0)


def _next_below(x: float) -> float:
    """The next float32 below x: one ulp of the log-probs' dtype."""
    return float(torch.nextafter(torch.tensor(x, dtype=torch.float32), torch.tensor(-math.inf)))


def _local(v: float, op: str) -> float:  # one rank
    return v


def test_proof_holds_when_the_sample_matches_and_recomputes_only_the_sample():
    exp = _experience()
    calls = []

    def recompute(sub):  # the trainer's forward, exact here
        calls.append(len(sub))
        return sub.rollout_logprobs.clone()

    proof = EngineLogprobProof(3, _local, seed=5)
    old, res = proof(exp, recompute, step=4, weights_verified=True)
    assert calls == [3] and res.held and res.sequences == 3 and res.tokens == int(exp.action_mask[list(res.rows)].sum())
    assert torch.equal(old, exp.rollout_logprobs) and old is not exp.rollout_logprobs
    assert proof.fallbacks == 0 and res.metrics(proof.fallbacks)["bitwise/engine_logprobs_used"] == 1.0
    # A fresh sample each step.
    assert {tuple(proof.sample_rows(len(exp), s)) for s in range(6)} != {res.rows}


@pytest.mark.parametrize("plant", ["one_ulp", "nan", "unverified_weights"])
def test_proof_fails_loudly_and_falls_back_to_the_full_recompute(plant, caplog):
    exp = _experience()
    proof = EngineLogprobProof(12, _local)  # every row sampled: the planted token is seen
    truth = exp.rollout_logprobs.clone()
    if plant == "one_ulp":
        truth[5, 0] = _next_below(float(truth[5, 0]))
    elif plant == "nan":
        truth[2, 0] = float("nan")
    recompute = lambda sub: truth.clone()  # noqa: E731  (every row is sampled, in order: sub has exp's shape)
    with caplog.at_level(logging.WARNING):
        for step in range(3):
            old, res = proof(exp, recompute, step=step, weights_verified=plant != "unverified_weights")
            assert not res.held and torch.equal(old.nan_to_num(), truth.nan_to_num())
    assert proof.fallbacks == 3 and res.metrics(proof.fallbacks)["bitwise/fallbacks"] == 3.0
    warnings = [r for r in caplog.records if "--precision.bitwise" in r.getMessage()]
    assert len(warnings) == 1  # once, then only the counter
    msg = warnings[0].getMessage()
    assert ("not verified" in msg) if plant == "unverified_weights" else ("1 of" in msg and "differ" in msg)


def test_zero_samples_always_recompute():
    exp = _experience()
    old, res = EngineLogprobProof(0, _local)(exp, lambda sub: torch.zeros(len(sub), sub.num_actions), step=0, weights_verified=True)
    assert not res.held and res.sequences == 0 and torch.equal(old, torch.zeros_like(old))


# ---- the trainer -------------------------------------------------------------------------------------------
def _trainer(task, tmp_path, recipe, *extra, engine_factory=None):
    from openrlhf.trainer.ppo_trainer import PPOTrainer
    from openrlhf.trainer.run import make_engine_factory, make_strategy

    model, data = task
    cfg = parse_config(grpo_args(model, data, tmp_path / "o", recipe, 2, ["--precision.bitwise", "--ckpt.save_steps", "-1", *extra]))
    st = make_strategy(cfg)
    st.setup_distributed()
    tr = PPOTrainer(cfg, st, engine_factory or make_engine_factory(cfg, st))
    tr.setup()
    return tr


def _run(tr, steps=2):
    seen = []
    fwd = tr.actor_engine.forward

    def count(sequences, *a, **kw):  # rows through the policy's forward while the experience is made
        if not torch.is_grad_enabled():
            seen.append(len(sequences))
        return fwd(sequences, *a, **kw)

    tr.actor_engine.forward = count
    out = []
    for _ in range(steps):
        seen.clear()
        m = tr.step().metrics
        out.append((m, sum(seen)))
    weights = torch.cat([p.detach().flatten() for p in tr.actor.parameters()])
    tr.close()
    return out, weights


@pytest.mark.integration
@pytest.mark.parametrize("recipe", ["jet_fp8", "bf16"])
def test_trainer_uses_the_engine_logprobs_when_proven(task, tmp_path, recipe):
    """The proof holds every step, only the sampled sequences go through the policy's forward, and the
    run is bit-identical to the same run recomputing every sequence."""
    tr = _trainer(task, tmp_path / "a", recipe)
    assert tr.precision_report.count("numerics: batch_invariant") == 1 and "precision check: OK" in tr.precision_report
    proven, w_proven = _run(tr)
    full, w_full = _run(_trainer(task, tmp_path / "b", recipe, "--precision.bitwise_check_samples", "0"))
    for (m, rows), (mf, rows_f) in zip(proven, full):
        assert m["bitwise/engine_logprobs_used"] == 1.0 and m["bitwise/fallbacks"] == 0.0
        assert m["bitwise/proof_sequences"] == 2 and m["bitwise/proof_tokens"] > 0 and m["bitwise/proof_mismatched_tokens"] == 0
        assert rows == 2 and rows_f == 128  # the recompute was skipped
        assert mf["bitwise/engine_logprobs_used"] == 0.0
        assert mf["rollout_train_mismatch/abs_logp_diff_max"] == 0.0  # every token of the full recompute is exact too
        for k in ("train/policy_loss", "train/clip_frac", "train/ratio_mean", "rollout/reward"):
            assert m[k] == mf[k], k
    assert torch.equal(w_proven, w_full)


@pytest.mark.integration
def test_the_reference_keeps_the_recipe_on_the_fastest_gemm(task, tmp_path):
    """Only the policy's forward must compute the engine's bits: the reference is converted with the same recipe
    and `auto`'s GEMM, the policy with the invariant one and a free backward."""
    from jetrl_precision import Fp8Linear

    tr = _trainer(task, tmp_path, "jet_fp8", "--algo.kl.use_loss", "--precision.gemm_backend", "emulated")
    try:
        policy = [m for m in tr.actor.modules() if isinstance(m, Fp8Linear)]
        ref = [m for m in tr.ref_engine.modules() if isinstance(m, Fp8Linear)]
        assert policy and all(m.gemm_backend == "emulated" and m.backward_gemm_backend == "auto" for m in policy)
        assert ref and all(m.gemm_backend == "auto" and m.frozen for m in ref)  # never trained: FP8 weights only
        assert {(m.fprop, m.backward_spec) for m in ref} == {(m.fprop, m.backward_spec) for m in policy}
    finally:
        tr.close()


class _Drifting(RolloutEngine):
    """A planted difference: the engine's log-probs are one ulp off on every sample's first token."""

    def __init__(self, inner: RolloutEngine) -> None:
        self.inner, self.name = inner, inner.name

    def generate(self, prompts, sampling):
        groups = self.inner.generate(prompts, sampling)
        for s in (s for g in groups for s in g):
            s.logprobs[0] = _next_below(s.logprobs[0])
        return groups

    def update_weights(self, tensors):
        return self.inner.update_weights(tensors)

    def weight_digests(self, names):
        return self.inner.weight_digests(names)

    def precision_graph(self):
        return self.inner.precision_graph()


@pytest.mark.integration
def test_trainer_falls_back_to_the_recompute_when_the_proof_fails(task, tmp_path, caplog):
    from openrlhf.trainer.run import make_strategy

    model, data = task
    cfg = parse_config(grpo_args(model, data, tmp_path / "o", "jet_fp8", 2, ["--precision.bitwise"]))
    factory = lambda recipe: _Drifting(build_engine(cfg, "hf", recipe, rank=0, dtype=torch.float32, device="cpu"))  # noqa: E731
    with caplog.at_level(logging.WARNING):
        drifting, w_drift = _run(_trainer(task, tmp_path / "a", "jet_fp8", engine_factory=factory))
    full, w_full = _run(_trainer(task, tmp_path / "b", "jet_fp8", "--precision.bitwise_check_samples", "0"))
    for i, ((m, rows), (mf, _)) in enumerate(zip(drifting, full)):
        assert m["bitwise/engine_logprobs_used"] == 0.0 and m["bitwise/fallbacks"] == i + 1
        assert m["bitwise/proof_mismatched_tokens"] == 2  # one planted token per sampled sequence
        assert rows == 2 + 128  # the sample, then every sequence
        assert m["rollout_train_mismatch/abs_logp_diff_max"] > 0
        # The fallback trained on the trainer's own recompute: the same losses as the run that always recomputes.
        assert m["train/policy_loss"] == mf["train/policy_loss"]
    assert torch.equal(w_drift, w_full)
    assert len([r for r in caplog.records if "--precision.bitwise" in r.getMessage()]) == 1


@pytest.mark.integration
def test_precision_check_refuses_an_engine_without_the_batch_invariant_numerics(task, tmp_path):
    from openrlhf.trainer.ppo_trainer import PrecisionCheckError

    model, _ = task
    ordinary = lambda recipe: HFEngine(str(model), recipe, dtype=torch.float32)  # noqa: E731
    with pytest.raises(PrecisionCheckError, match="numerics expected batch_invariant"):
        _trainer(task, tmp_path, "jet_fp8", engine_factory=ordinary)


@pytest.mark.integration
@pytest.mark.slow
def test_two_ranks_zero3_decide_together(task, tmp_path):
    """Under ZeRO-3 every forward is collective: both ranks check their own sample and take the same branch."""
    from _rl_helpers import free_port, metrics, run

    model, data = task
    out = tmp_path / "z3"
    args = grpo_args(model, data, out, "jet_fp8", 2, ["--ds.zero_stage", "3", "--precision.bitwise", "--ckpt.save_steps", "-1"])
    run(["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "openrlhf/cli/train_ppo_ray.py", *args], timeout=900)
    hist = metrics(out)
    assert len(hist) == 2
    for m in hist:
        assert m["bitwise/engine_logprobs_used"] == 1.0 and m["bitwise/proof_sequences"] == 4  # 2 per rank
        assert m["bitwise/proof_mismatched_tokens"] == 0 and m["rollout_train_mismatch/num_tokens"] == m["bitwise/proof_tokens"] > 0


# ---- refusals ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,needles", [
    (["--precision.recipe", "fp8_rollout"], ["needs an on-policy recipe", "fp8_rollout"]),
    (["--fp8_unified", "--precision.gemm_backend", "torch"], ["torch FP8 GEMM is not batch-invariant", "emulated"]),
    (["--ds.attn_implementation", "eager"], ["jetrl_invariant", "--ds.attn_implementation eager"]),
])
def test_config_refusals_name_what_is_missing(extra, needles):
    with pytest.raises(ConfigError) as e:
        _cfg("--precision.bitwise", *extra)
    msg = str(e.value)
    assert all(n in msg for n in needles) and "\n" not in msg, msg


def test_vllm_bitwise_is_cuda_only_and_auto_picks_it_only_on_cuda(peaky):
    cfg = _cfg("--precision.bitwise", "--fp8_unified")
    vllm_cfg = _cfg("--precision.bitwise", "--fp8_unified", "--rollout.engine", "vllm")
    assert preflight_errors(cfg, cuda=True) == [] and preflight_errors(cfg, cuda=False) == []
    assert preflight_errors(vllm_cfg, cuda=True) == []
    errors = preflight_errors(vllm_cfg, cuda=False)
    assert len(errors) == 1 and "runs on CUDA" in errors[0] and "--rollout.engine hf" in errors[0], errors
    assert engine_kind("auto", bitwise=True, cuda=False) == "hf" and engine_kind("vllm", bitwise=True) == "vllm"
    has_vllm = importlib.util.find_spec("vllm") is not None
    assert engine_kind("auto", bitwise=True, cuda=True) == ("vllm" if has_vllm else "hf")
    assert engine_kind("auto", bitwise=True) == engine_kind("auto", bitwise=True, cuda=torch.cuda.is_available())
    if not torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None:
        real = _cfg("--precision.bitwise", "--fp8_unified", "--rollout.engine", "vllm", "--actor.model_name_or_path", str(peaky))
        with pytest.raises(BitwiseUnavailable, match="runs on CUDA"):  # before vLLM starts
            build_engine(real, "vllm", get_recipe("jet_fp8"), rank=0, dtype=torch.float32, device="cpu")
    with pytest.raises(BitwiseUnavailable, match="attention sdpa"):
        HFEngine(str(peaky), get_recipe("jet_fp8"), dtype=torch.float32, batch_invariant=True)
    assert cfg.policy_attn_implementation == "jetrl_invariant" and _cfg().policy_attn_implementation == "sdpa"
