"""OpenRLHF v0.11 flags that change what a run does, each checked for its effect (or its refusal):
the critic's own clipping norm and value head, EMA of the actor, the final export, checkpoint pruning by
size (--ckpt.max_mem) and HF-only checkpoints (--ckpt.disable_ds), blended prompt datasets
(--data.prompt_probs), MoE expert kernels, the reward model's host offload, ZeRO++ partitioning
(--ds.zpg) and universal checkpoints, on real DeepSpeed engines (gloo, CPU)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import pytest
import torch

from _rl_helpers import ENV, PY, REPO, grpo_args, make_reward_model, metrics, run
from openrlhf.config import ConfigError, parse_config
from openrlhf.trainer.preflight import preflight_errors
from precision_testutil import assert_within, gamma

JOBS = Path(__file__).with_name("ds_jobs.py")


def _cfg(*extra: str, model: str = "m", data: str = "d.jsonl"):
    return parse_config(["--actor.model_name_or_path", model, "--data.prompt_dataset", data, *extra], exit_on_error=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from openrlhf.utils.tiny_model import TinyModelSpec, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", TinyModelSpec(num_hidden_layers=1))


# ---- refusals and warnings: one line naming the flag and the way out -------------------------------
@pytest.mark.parametrize("extra,needles", [
    (["--actor.aux_loss_coef", "0.01"], ["--actor.aux_loss_coef", "router logits", "drop the flag"]),
    (["--ds.experts_implementation", "deepgemm"], ["--ds.experts_implementation deepgemm", "grouped_mm"]),
])
def test_preflight_refuses(extra, needles):
    errors = preflight_errors(_cfg(*extra), cuda=False)
    assert len(errors) == 1 and all(n in errors[0] for n in needles), errors


@pytest.mark.parametrize("extra,needles", [
    (["--ckpt.disable_ds", "--ckpt.load_enable"], ["--ckpt.disable_ds", "--ckpt.load_enable", "nothing to resume"]),
    (["--ds.zpg", "2", "--ds.zero_stage", "2"], ["--ds.zpg 2", "--ds.zero_stage 3"]),
    (["--data.prompt_probs", "0.5,0.5"], ["2 weights for 1", "one weight per source"]),
    (["--data.prompt_dataset", "a.jsonl,b.jsonl", "--data.prompt_probs", "1,0"], ["finite number > 0"]),
    (["--data.prompt_dataset", "a.jsonl,b.jsonl", "--data.prompt_probs", "1,x"], ["comma-separated list of numbers"]),
])
def test_validation_refuses(extra, needles):
    with pytest.raises(ConfigError) as e:
        _cfg(*extra)
    assert all(n in str(e.value) for n in needles), str(e.value)


@pytest.mark.parametrize("extra,needle", [
    (["--vllm.sync_with_ray"], "--vllm.sync_with_ray"),
    (["--data.dataloader_num_workers", "4"], "--data.dataloader_num_workers 4"),
    (["--ds.use_universal_ckpt"], "without --ckpt.load_enable"),
])
def test_flags_without_effect_here_warn(extra, needle):
    cfg = _cfg(*extra)
    assert any(needle in w for w in cfg.cfg_warnings), cfg.cfg_warnings


# ---- checkpoint pruning: --ckpt.max_num and --ckpt.max_mem ------------------------------------------
def test_stale_tags_keep_count_and_size(tmp_path):
    from openrlhf.utils.deepspeed.checkpoint import stale_tags

    for step, kib in [(1, 600), (2, 300), (3, 300), (10, 500)]:
        (tmp_path / f"global_step{step}").mkdir()
        (tmp_path / f"global_step{step}" / "w.bin").write_bytes(b"\0" * kib * 1024)
    (tmp_path / "global_step4.partial").mkdir()  # not a checkpoint: never counted or removed
    gib = 1024 * 1024  # KiB per GiB
    assert stale_tags(tmp_path, "global_step10", 3) == ["global_step1"]
    assert stale_tags(tmp_path, "global_step10", 10) == []
    # 1700 KiB in all; to fit 1000 KiB the two oldest go (numeric order: step 10 is the newest)
    assert stale_tags(tmp_path, "global_step10", 10, 1000 / gib) == ["global_step1", "global_step2"]
    assert stale_tags(tmp_path, "global_step10", 10, 1100 / gib) == ["global_step1"]
    # the checkpoint just saved stays even when it alone is over the budget
    assert stale_tags(tmp_path, "global_step10", 10, 100 / gib) == ["global_step1", "global_step2", "global_step3"]


# ---- --data.prompt_probs: several sources blended at the given rates -----------------------------
def _write(path: Path, n: int, tag: str) -> str:
    path.write_text("".join(json.dumps({"input": f"{tag}{i}", "label": str(i), "extra_" + tag: 1}) + "\n" for i in range(n)))
    return str(path)


def test_blend_draws_each_source_at_its_rate(tmp_path):
    from openrlhf.datasets.prompts_dataset import blend_prompt_records

    a, b = _write(tmp_path / "a.jsonl", 40, "a"), _write(tmp_path / "b.jsonl", 10, "b")
    # without weights: concatenated, in order (OpenRLHF's behaviour)
    assert [r["input"] for r in blend_prompt_records(f"{a},{b}")] == [f"a{i}" for i in range(40)] + [f"b{i}" for i in range(10)]
    mixed = blend_prompt_records(f"{a}, {b}", "1,3", seed=7)
    from_a = sum(r["input"].startswith("a") for r in mixed)
    from_b = len(mixed) - from_a
    # "all_exhausted": drawing stops once the 40 a-records have all come up, so every record of both appears
    assert {r["input"] for r in mixed} == {f"a{i}" for i in range(40)} | {f"b{i}" for i in range(10)}
    assert from_a == 40 and from_b > 40  # b is oversampled, about 3 draws for every a draw
    p_b = from_b / len(mixed)
    sigma = (0.75 * 0.25 / len(mixed)) ** 0.5
    assert abs(p_b - 0.75) < 5 * sigma, (from_a, from_b)
    # seeded: the same seed gives the same blend, another seed another one; max_samples cuts each source and the blend
    assert blend_prompt_records(f"{a},{b}", "1,3", seed=7) == mixed
    assert blend_prompt_records(f"{a},{b}", "1,3", seed=8) != mixed
    cut = blend_prompt_records(f"{a},{b}", "1,1", max_samples=8, seed=7)
    assert len(cut) == 8 and all(int(r["label"]) < 8 for r in cut)


# ---- experts implementation ------------------------------------------------------------------------
def test_experts_implementation_reaches_transformers(tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    from openrlhf.models.actor import load_causal_lm

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    MixtralForCausalLM(cfg).save_pretrained(tmp_path / "moe")
    ids = torch.randint(0, 64, (2, 9))
    logits = {}
    for impl in ("eager", "batched_mm"):
        model = load_causal_lm(str(tmp_path / "moe"), torch.float32, "sdpa", impl)
        assert model.config._experts_implementation == impl
        logits[impl] = model(input_ids=ids).logits.detach()
    # the two kernels compute the same expert sums; a dense fp32 bound over the model's accumulations
    scale = logits["eager"].abs().amax()
    assert_within(logits["batched_mm"], logits["eager"], 64 * gamma(4 * 96) * max(float(scale), 1.0), "batched_mm vs eager logits")


# ---- --reward.offload -------------------------------------------------------------------------------
def test_reward_model_offload_scores_the_same_and_rests_on_the_host(tmp_path, tiny):
    from openrlhf.trainer.reward import RewardModelFn

    rm_dir = make_reward_model(tiny, tmp_path / "rm")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    plain = RewardModelFn(str(rm_dir), torch.float32, device)
    offloaded = RewardModelFn(str(rm_dir), torch.float32, device, offload=True)
    args = (["1+1=", "2+2="], ["2", "5"], [None, None])
    assert offloaded(*args) == plain(*args)
    assert all(p.device.type == "cpu" for p in offloaded.model.parameters())  # between calls
    assert all(p.device == device for p in plain.model.parameters())


def test_reward_model_head_is_read_under_its_prefix_or_refused(tmp_path, tiny):
    """A checkpoint without the named head would score with a random one: refused, naming --ds.value_head_prefix."""
    from openrlhf.trainer.reward import RewardModelFn

    rm_dir = make_reward_model(tiny, tmp_path / "rm")
    with pytest.raises(ConfigError, match="no one-output value head named value_head.weight.*--ds.value_head_prefix"):
        RewardModelFn(str(rm_dir), torch.float32, torch.device("cpu"), value_head_prefix="value_head")
    with pytest.raises(ConfigError, match="no one-output value head named score.weight"):
        RewardModelFn(str(tiny), torch.float32, torch.device("cpu"))  # a causal LM, not a reward model
    # OpenRLHF's reward models store the head as value_head.weight: read under that name
    from safetensors.torch import load_file, save_file

    renamed = tmp_path / "rm_value_head"
    import shutil

    shutil.copytree(rm_dir, renamed)
    state = load_file(renamed / "model.safetensors")
    state["value_head.weight"] = state.pop("score.weight")
    save_file(state, renamed / "model.safetensors", metadata={"format": "pt"})
    a = RewardModelFn(str(renamed), torch.float32, torch.device("cpu"), value_head_prefix="value_head")
    b = RewardModelFn(str(rm_dir), torch.float32, torch.device("cpu"))
    for (n, x), (_, y) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(x, y), n


# ---- the critic: its own clipping norm, packing, and the value head a checkpoint brings -------------
def _strategy(cfg):
    from openrlhf.trainer.run import make_strategy

    st = make_strategy(cfg)
    st.setup_distributed()
    return st


@pytest.mark.integration
def test_critic_engine_clips_with_the_critic_norm(tiny):
    from jetrl_precision import Fp8Converter
    from openrlhf.trainer.ppo_trainer import prepare_critic

    cfg = _cfg("--algo.advantage.estimator", "gae", "--critic.max_norm", "0.25", "--actor.max_norm", "2.0", "--ds.packing_samples",
               "--ds.param_dtype", "fp32", "--train.batch_size", "2", "--rollout.batch_size", "2", model=str(tiny))
    st = _strategy(cfg)
    critic = prepare_critic(cfg, st, Fp8Converter(cfg.precision.load_recipe()), total_updates=4)
    assert critic.gradient_clipping() == 0.25 and critic.module.packing
    lin = torch.nn.Linear(4, 4)
    actor = st.prepare(lin, torch.optim.AdamW(lin.parameters()))
    assert actor.gradient_clipping() == 2.0  # the actor keeps --actor.max_norm


@pytest.mark.integration
def test_critic_takes_the_value_head_of_a_reward_model_and_exports_as_one(tmp_path, tiny):
    from transformers import AutoModelForSequenceClassification

    from openrlhf.models.actor import Critic

    rm = AutoModelForSequenceClassification.from_pretrained(tiny, num_labels=1)
    torch.nn.init.normal_(rm.score.weight, std=0.5)
    rm.save_pretrained(tmp_path / "rm")
    critic = Critic.from_pretrained(str(tmp_path / "rm"), torch.float32)
    assert torch.equal(critic.score.weight, rm.score.weight)
    assert all(torch.equal(a, b) for a, b in zip(critic.model.parameters(), rm.model.parameters()))
    # another --ds.value_head_prefix: no such tensor there, so the head starts at zero
    fresh = Critic.from_pretrained(str(tmp_path / "rm"), torch.float32, value_head_prefix="value_head")
    assert not fresh.score.weight.any()
    # exported (--critic.save_value_network), the critic loads back as a one-label reward model, bit for bit
    critic.save_pretrained(tmp_path / "out", critic.state_dict())
    back = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    assert back.config.num_labels == 1
    for (n, a), (_, b) in zip(back.named_parameters(), rm.named_parameters()):
        assert torch.equal(a, b), n
    # with another prefix the head is stored under that name, as OpenRLHF's loaders look for it
    critic.save_pretrained(tmp_path / "out2", critic.state_dict(), value_head_prefix="value_head")
    again = Critic.from_pretrained(str(tmp_path / "out2"), torch.float32, value_head_prefix="value_head")
    assert torch.equal(again.score.weight, rm.score.weight)


# ---- --train.enable_ema --------------------------------------------------------------------------
def _ema_engine(stage: int):
    from openrlhf.utils.deepspeed import DeepspeedStrategy, StrategyConfig

    st = DeepspeedStrategy(StrategyConfig(zero_stage=stage, param_dtype="fp32", micro_batch_size=2, train_batch_size=2))
    st.setup_distributed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 8))
    return st, st.prepare(model, st.make_optimizer(model, 3e-2, (0.9, 0.95), 1e-8, 0.0))


@pytest.mark.integration
@pytest.mark.parametrize("stage", [2, 3])
def test_ema_follows_the_recurrence_and_survives_a_checkpoint(stage, tmp_path, single_thread, caplog):
    from openrlhf.utils.deepspeed.ema import ParameterEMA

    st, engine = _ema_engine(stage)
    beta, steps = 0.7, 4
    ema = ParameterEMA(engine.module, beta, st.rank, st.device)
    def snapshot():
        return {k: v.clone() for k, v in st.model_state_dict(engine, engine.module).items()}

    snapshots = [snapshot()]
    for k in range(steps):
        x = torch.randn(2, 32, generator=torch.Generator().manual_seed(k))
        engine.backward(engine(x).square().mean())
        engine.step()
        ema.update()
        snapshots.append(snapshot())
    got = ema.state_dict()
    for name in got:
        # closed form in float64: beta^k p_0 + sum_j (1 - beta) beta^(k - j) p_j
        ref = beta**steps * snapshots[0][name].double()
        ref += sum((1 - beta) * beta ** (steps - j) * snapshots[j][name].double() for j in range(1, steps + 1))
        big = max(s[name].abs().max().item() for s in snapshots)
        # each step rounds beta*e, (1-beta)*p and their sum (and beta, 1-beta themselves): 6 roundings of values <= big
        assert_within(got[name], ref, steps * gamma(6) * 2 * big, f"EMA of {name}")
        assert not torch.equal(got[name], snapshots[-1][name])  # it is an average, not the last weights
    ema.save(tmp_path)
    restored = ParameterEMA(engine.module, beta, st.rank, st.device)
    restored.load(tmp_path)
    assert all(torch.equal(restored.state_dict()[n], got[n]) for n in got)
    # a checkpoint without EMA state: the average restarts at the loaded weights, and the log says so
    empty = tmp_path / "none"
    empty.mkdir()
    with caplog.at_level(logging.WARNING):
        restored.load(empty)
    assert "restarts at the loaded weights" in caplog.text
    assert all(torch.equal(restored.state_dict()[n], snapshots[-1][n]) for n in got)


# ---- --ds.zpg and --ds.use_universal_ckpt on several ranks -------------------------------------------
def _torchrun(n: int, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run(["torchrun", "--nproc_per_node", str(n), "--standalone", str(JOBS), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.integration
@pytest.mark.slow
def test_zpg_hierarchical_partitioning_trains_fp8_layers_bit_exactly(tmp_path):
    """4 ranks of ZeRO-3 with a secondary partition per 2 ranks (--ds.zpg 2) train the FP8 layers exactly as plain ZeRO-3."""
    _torchrun(4, "zpg", str(tmp_path / "out.json"))
    out = json.loads((tmp_path / "out.json").read_text())
    assert out == {"world": 4, "hpz": [1, 2], "equal": True, "moved": True}


def test_zpg_must_divide_the_world_size():
    from openrlhf.utils.deepspeed import DeepspeedStrategy, StrategyConfig

    with pytest.raises(ConfigError, match="--ds.zpg 3 must divide the world size 1"):
        DeepspeedStrategy(StrategyConfig(zero_stage=3, zpg=3, train_batch_size=1)).setup_distributed()


@pytest.mark.integration
@pytest.mark.slow
def test_universal_checkpoint_resumes_at_another_world_size(tmp_path):
    """Saved by 2 ZeRO-2 ranks, converted with DeepSpeed's ds_to_universal (no extra flags: our checkpoints carry
    the state it needs), resumed by 1 rank with --ds.use_universal_ckpt: the same weights, optimizer step and client state."""
    ckpt = tmp_path / "ckpt"
    _torchrun(2, "universal-save", str(ckpt))
    # before conversion, asking for a universal checkpoint names the command that makes one
    proc = subprocess.run(["torchrun", "--nproc_per_node", "1", "--standalone", str(JOBS), "universal-load", str(ckpt), str(tmp_path / "x")],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "deepspeed.checkpoint.ds_to_universal --input_folder" in proc.stderr
    run([PY, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ckpt / "global_step2"),
         "--output_folder", str(ckpt / "global_step2_universal")])
    _torchrun(1, "universal-load", str(ckpt), str(tmp_path / "out.json"))
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["world"] == 1 and out["equal"] and out["optimizer_step"] == 2
    assert out["client"]["global_step"] == 2 and out["client"]["note"] == "saved at world size 2"


# ---- a whole run: final export, EMA, the critic's export, HF-only checkpoints, blended prompts -------
@pytest.mark.integration
@pytest.mark.slow
def test_run_exports_ema_and_critic_with_hf_only_checkpoints(task, tmp_path):
    """GAE with --train.enable_ema --train.ema_beta 1 (the average never leaves the initial weights, so the export
    must equal them although training moved the actor), --critic.save_value_network, --ckpt.disable_ds with a
    checkpoint every step kept to one, and two prompt files blended by --data.prompt_probs."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    model, data = task
    second = tmp_path / "second.jsonl"
    second.write_text("".join(data.read_text().splitlines(keepends=True)[:64]))
    out = tmp_path / "run"
    extra = [
        "--algo.advantage.estimator", "gae", "--rollout.n_samples_per_prompt", "2", "--rollout.batch_size", "16",
        "--train.batch_size", "16", "--train.micro_batch_size", "8",
        "--train.enable_ema", "--train.ema_beta", "1.0", "--critic.save_value_network",
        "--ckpt.disable_ds", "--ckpt.save_steps", "1", "--ckpt.max_num", "1",
        "--data.prompt_dataset", f"{data},{second}", "--data.prompt_probs", "0.5,0.5",
    ]
    run([PY, "-m", "openrlhf.cli.train_ppo_ray", *grpo_args(model, data, out, "jet_fp8", 1, extra)], timeout=900)
    assert [h["step"] for h in metrics(out)] == [1, 2]
    initial = AutoModelForCausalLM.from_pretrained(model)
    final = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(a, b) for a, b in zip(final.state_dict().values(), initial.state_dict().values()))
    # the critic trained: its value head left zero; it loads as a one-label reward model
    critic = AutoModelForSequenceClassification.from_pretrained(str(out) + "_critic")
    assert critic.score.weight.abs().sum() > 0
    # HF-only checkpoints, checksummed and pruned to --ckpt.max_num; no DeepSpeed state was written
    ckpt = out / "checkpoints_ppo"
    assert not (ckpt / "actor").exists() and not (ckpt / "critic").exists()
    assert sorted(p.name for p in (ckpt / "hf").iterdir() if p.is_dir()) == ["global_step2"]
    assert (ckpt / "hf" / "global_step2" / "CHECKSUMS.json").is_file() and (ckpt / "hf" / "latest").read_text() == "global_step2"


# ---- DeepSpeed AutoTP, then FP8 ---------------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.slow
def test_autotp_shards_convert_to_fp8_with_the_unsharded_bytes(tmp_path):
    """2 gloo ranks: AutoTP shards a Llama (q/k/v/gate/up by rows, o/down by columns), the shards become FP8 layers;
    each quantizes to its slice of the unsharded layer's bytes and scales, the gathered weight is the unsharded one,
    and forward, DGrad and WGrad match the unsharded FP8 layer within their fp32 accumulation bounds (exactly where
    one GEMM computes both); one DeepSpeed step of the sharded model trains it, the same loss on both ranks."""
    _torchrun(2, "tp", str(tmp_path / "out.json"))
    ranks = json.loads((tmp_path / "out.json").read_text())["ranks"]
    assert len(ranks) == 2
    for r in ranks:
        assert r["kinds"] == {
            **{f"model.layers.0.self_attn.{p}_proj": "Fp8ColumnParallelLinear" for p in "qkv"},
            "model.layers.0.self_attn.o_proj": "Fp8RowParallelLinear",
            "model.layers.0.mlp.gate_proj": "Fp8ColumnParallelLinear", "model.layers.0.mlp.up_proj": "Fp8ColumnParallelLinear",
            "model.layers.0.mlp.down_proj": "Fp8RowParallelLinear",
        }
        assert all(r["bytes"].values()) and all(r["gathered"].values()), r
        assert all(w <= 1.0 for layer in r["worst"].values() for w in layer.values()), r["worst"]
        assert r["shard_shapes"]["model.layers.0.mlp.down_proj"] == [256, 256] and r["moved"]
    assert ranks[0]["loss"] == ranks[1]["loss"]


def test_autotp_shards_that_cut_fp8_blocks_are_refused():
    from openrlhf.trainer.preflight import fp8_tp_shard_errors

    llama_8b = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8}
    assert fp8_tp_shard_errors(llama_8b, 8) == []
    cut = fp8_tp_shard_errors({**llama_8b, "intermediate_size": 11008}, 8)  # 1376 per rank
    assert len(cut) == 2 and all("not a multiple of 128" in e for e in cut)


def _engine_tp_errors(tmp_path, model: dict, tp: int, *extra: str, cuda: bool = False, ray: bool = False,
                      recipe: str = "jet_fp8") -> list[str]:
    from openrlhf.config import parse_config
    from openrlhf.trainer.preflight import preflight_errors

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **model}))
    cfg = parse_config(["--actor.model_name_or_path", str(tmp_path), "--data.prompt_dataset", "d.jsonl", "--precision.recipe", recipe,
                        "--rollout.engine", "vllm", "--vllm.tensor_parallel_size", str(tp), *extra], exit_on_error=False)
    # `ray` given, not read from this process's environment (an earlier in-process DeepSpeed test may leave RANK set)
    return [e for e in preflight_errors(cfg, cuda=cuda, ray=ray) if "--vllm.tensor_parallel_size" in e]


def test_tensor_parallel_engines_run_where_shards_keep_fp8_blocks_whole(tmp_path):
    """vLLM engines over several workers: accepted for 8B shapes (K/V heads replicated past 8 ranks), refused in one
    line where a shard would cut a 128x128 block, with bitwise mode, for fused checkpoints, and in SPMD on GPUs."""
    llama_8b = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8}
    for tp in (2, 4, 8, 16):
        assert _engine_tp_errors(tmp_path, llama_8b, tp) == [], tp
    assert _engine_tp_errors(tmp_path, llama_8b, 2, "--vllm.num_engines", "2", cuda=True, ray=True) == []  # Ray mode on GPUs
    spmd = _engine_tp_errors(tmp_path, llama_8b, 2, cuda=True)
    assert len(spmd) == 1 and "Ray mode" in spmd[0] and "--vllm.num_engines" in spmd[0]
    cut = _engine_tp_errors(tmp_path, {**llama_8b, "intermediate_size": 11008}, 8)  # 1376 rows per worker
    assert len(cut) == 2 and all("not a multiple of 128" in e for e in cut)
    smollm2 = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3}
    assert any("heads" in e for e in _engine_tp_errors(tmp_path, smollm2, 2))  # 9 heads do not split in two
    assert any("q_proj rows" in e for e in _engine_tp_errors(tmp_path, smollm2, 3))  # 192-row shards
    assert any("bit-exact" in e for e in _engine_tp_errors(tmp_path, llama_8b, 2, "--precision.bitwise"))
    fused = _engine_tp_errors(tmp_path, {**llama_8b, "model_type": "phi3"}, 2)
    assert len(fused) == 1 and "fused" in fused[0]
    moe = _engine_tp_errors(tmp_path, {**llama_8b, "model_type": "qwen3_moe", "num_experts": 8}, 2)
    assert len(moe) == 1 and "mixture-of-experts" in moe[0]
    # bf16: no FP8 blocks to keep whole
    assert _engine_tp_errors(tmp_path, {**llama_8b, "intermediate_size": 11008}, 8, recipe="bf16") == []
