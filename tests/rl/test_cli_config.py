"""The configuration layer (openrlhf.config): flags -> typed frozen dataclasses -> validation."""

from __future__ import annotations

import dataclasses
import logging
import random
import re
from pathlib import Path

import pytest
import yaml

from openrlhf.config import (
    GROUP_ESTIMATORS,
    ConfigError,
    PPOConfig,
    build_parser,
    flag_specs,
    parse_config,
    parse_unvalidated,
    validate,
)
from openrlhf.config.docs import render_alias_table, render_flag_table, render_parity_table

BASE = ["--pretrain", "some/model", "--prompt_data", "tasks.jsonl"]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def get(cfg, dest: str):
    for part in dest.split("."):
        cfg = getattr(cfg, part)
    return cfg


def exit_message(capsys, argv) -> str:
    """Run parse_config, expect the argparse-style exit (status 2), return stderr."""
    with pytest.raises(SystemExit) as info:
        parse_config(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def config_error(argv) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(argv, exit_on_error=False)
    return str(info.value)


def random_value(spec, rng: random.Random) -> tuple[list[str], object]:
    """Command-line tokens and the parsed value for `spec`, never equal to its default."""
    while True:
        if spec.type is bool:
            return [], True
        if spec.choices is not None:
            value = rng.choice([c for c in spec.choices if c != spec.default])
            return [str(value)], value
        if spec.nargs == "*":
            value = tuple(f"m{rng.randrange(10**6)}" for _ in range(rng.randint(1, 3)))
        elif spec.nargs:
            value = tuple(sorted(round(rng.uniform(-50, 50), 4) for _ in range(spec.nargs)))
        elif spec.type is int:
            value = rng.randint(2, 100_000)
        elif spec.type is float:
            value = rng.uniform(1e-4, 1e3) * rng.choice([1.0, 1e-5])
        else:
            value = f"v{rng.randrange(10**9)}/x"
        if value != spec.default:
            tokens = [str(v) if spec.nargs == "*" else repr(v) for v in value] if spec.nargs else [str(value)]
            return tokens, value


# ---- mapping --------------------------------------------------------------------------------
def test_defaults():
    cfg = parse_config(BASE)
    assert cfg == dataclasses.replace(
        PPOConfig(),
        actor=dataclasses.replace(PPOConfig().actor, model_name_or_path="some/model"),
        data=dataclasses.replace(PPOConfig().data, prompt_dataset="tasks.jsonl"),
    )
    assert cfg.actor.adam.lr == 1e-6 and cfg.critic.adam.lr == 9e-6
    assert cfg.actor.adam.betas == (0.9, 0.95) and cfg.critic.adam.betas == (0.9, 0.95)
    assert cfg.actor.lr_scheduler == "cosine_with_min_lr" and cfg.actor.eps_clip == 0.2
    assert cfg.rollout.batch_size == 1024 and cfg.train.batch_size == 128 and cfg.train.seed == 42
    assert cfg.rollout.engine == "auto" and cfg.rollout.top_k == -1 and cfg.rollout.max_new_tokens is None
    assert cfg.algo.advantage.estimator == "gae" and cfg.algo.kl.init_coef == 0.01 and cfg.algo.kl.estimator == "k1"
    assert cfg.algo.advantage.is_correction_threshold == (0.5, 5.0) and cfg.algo.advantage.is_correction_type == "tis"
    assert cfg.ds.zero_stage == 2 and cfg.ds.param_dtype == "bf16" and cfg.ds.attn_implementation == "sdpa"
    assert cfg.vllm.gpu_memory_utilization == 0.95 and cfg.vllm.sync_backend == "auto" and cfg.vllm.num_engines is None
    assert cfg.ckpt.output_dir == "./ckpt" and cfg.ckpt.save_steps == -1 and cfg.ckpt.max_num == 3
    assert cfg.logger.wandb.project == "openrlhf_train_ppo" and cfg.logger.wandb.mode == "online"
    assert cfg.reward.clip_range == (-10.0, 10.0) and cfg.data.max_len == 2048 and cfg.data.input_key == "input"
    assert cfg.precision.recipe == "bf16" and cfg.precision.gemm_backend == "auto" and not cfg.precision.strict
    assert cfg.local_rank == -1 and cfg.cfg_warnings == ()
    # Switches are off by default; Muon's Nesterov momentum is on (as in OpenRLHF) and --*.muon.no_nesterov turns it off.
    assert all(get(cfg, s.dest) is (s.dest.endswith(".muon.nesterov")) for s in flag_specs() if s.type is bool)


def test_ignore_eos_reaches_the_engines_sampling():
    from openrlhf.trainer.engines.factory import default_sampling

    assert default_sampling(parse_config([*BASE, "--rollout.ignore_eos"]).rollout, 64).ignore_eos
    assert not default_sampling(parse_config(BASE).rollout, 64).ignore_eos


def test_every_alias_maps_to_its_dotted_field():
    rng = random.Random(1234)
    checked = 0
    for spec in flag_specs():
        for alias in spec.aliases:
            tokens, value = random_value(spec, rng)
            via_dotted = parse_unvalidated([spec.flag, *tokens])
            via_alias = parse_unvalidated([alias, *tokens])
            assert get(via_dotted, spec.dest) == value, (spec.flag, tokens)
            assert via_alias == via_dotted, (alias, spec.flag)
            assert get(via_alias, spec.dest) != spec.default
            checked += 1
    assert checked >= 80  # every flat name OpenRLHF users know


def test_all_dotted_flags_at_once_round_trip():
    rng = random.Random(99)
    argv, expected = [], {}
    for spec in flag_specs():
        tokens, value = random_value(spec, rng)
        argv += [spec.flag, *tokens]
        expected[spec.dest] = value
    cfg = parse_unvalidated(argv)
    for dest, value in expected.items():
        got = get(cfg, dest)
        assert got == value and type(got) is type(value), dest
    assert PPOConfig.from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg


def test_nested_sections_keep_separate_defaults_and_aliases():
    cfg = parse_unvalidated(["--actor_learning_rate", "3e-7", "--critic_learning_rate", "2e-5"])
    assert cfg.actor.adam.lr == 3e-7 and cfg.critic.adam.lr == 2e-5
    cfg = parse_unvalidated(["--critic.adam.betas", "0.8", "0.9"])
    assert cfg.critic.adam.betas == (0.8, 0.9) and cfg.actor.adam.betas == (0.9, 0.95)


def test_negative_tuple_values_and_equals_syntax():
    cfg = parse_unvalidated(["--reward.clip_range", "-3.5", "-0.25", "--train.seed=-7", "--rollout.top_k=-1"])
    assert cfg.reward.clip_range == (-3.5, -0.25) and cfg.train.seed == -7


def test_fp8_unified_and_bf16_shortcuts():
    assert parse_config([*BASE, "--fp8_unified"]).precision.recipe == "jet_fp8"
    assert parse_config([*BASE, "--fp8_unified", "--precision.recipe", "jet_fp8"]).precision.recipe == "jet_fp8"
    assert parse_config([*BASE, "--bf16"]).ds.param_dtype == "bf16"
    assert parse_config([*BASE, "--ds.param_dtype", "fp32"]).ds.param_dtype == "fp32"


@pytest.mark.parametrize(
    "argv, rank",
    [(["--local_rank=0"], 0), (["--local_rank", "3"], 3), (["--local-rank=5"], 5), ([], -1)],
)
def test_deepspeed_local_rank(argv, rank):
    assert parse_config([*argv, *BASE]).local_rank == rank


# ---- command-line mistakes ----------------------------------------------------------------------
def test_unknown_flag_suggests_dotted_name(capsys):
    err = exit_message(capsys, [*BASE, "--actor.lr", "1e-5"])
    assert "unrecognized argument --actor.lr; did you mean --actor.adam.lr" in err
    assert "1e-5" not in err.splitlines()[-1]  # the value is not reported as a second unknown


@pytest.mark.parametrize(
    "flag, suggestion",
    [
        ("--pretrian", "--actor.model_name_or_path"),  # a typo of a flat alias suggests the dotted name
        ("--rollout.n_sample_per_prompt", "--rollout.n_samples_per_prompt"),
        ("--lr", "--actor.adam.lr"),  # by leaf name
        ("--algo.kl.coef", "--algo.kl.init_coef"),
        ("--fp8-unified", "--fp8_unified"),
    ],
)
def test_unknown_flag_suggestions(capsys, flag, suggestion):
    err = exit_message(capsys, [*BASE, flag, "1"])
    line = next(x for x in err.splitlines() if "unrecognized argument" in x)
    assert line.split("did you mean ")[1].split(" or ")[0].rstrip("?") == suggestion


def test_no_prefix_matching_and_stray_values(capsys):
    err = exit_message(capsys, [*BASE, "--actor.adam.l", "1e-5"])
    assert "unrecognized argument --actor.adam.l;" in err
    err = exit_message(capsys, [*BASE, "--train.colocate_all", "true"])
    assert "unrecognized argument(s): true" in err


def test_bad_type_and_choice_are_argparse_errors(capsys):
    err = exit_message(capsys, [*BASE, "--train.batch_size", "lots"])
    assert "--train.batch_size: invalid int value: 'lots'" in err
    err = exit_message(capsys, [*BASE, "--algo.advantage.estimator", "grpo"])
    assert "--algo.advantage.estimator: invalid choice: 'grpo'" in err


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--pretrain", "a", "--actor.model_name_or_path", "b"], ("--pretrain a", "--actor.model_name_or_path b")),
        (["--precision.recipe", "bf16", "--fp8_unified"], ("--precision.recipe bf16", "--fp8_unified (= jet_fp8)")),
        (["--max_new_tokens", "64", "--generate_max_len", "128"], ("--max_new_tokens 64", "--generate_max_len 128")),
        (["--ds.param_dtype", "fp16", "--bf16"], ("--ds.param_dtype fp16", "--bf16 (= bf16)")),
        (["--eps_clip_low_high", "0.2", "0.3", "--actor.eps_clip_low_high", "0.2", "0.28"],
         ("--eps_clip_low_high 0.2 0.3", "--actor.eps_clip_low_high 0.2 0.28")),
    ],
)
def test_alias_and_dotted_conflict(capsys, argv, named):
    err = exit_message(capsys, [*BASE, *argv])
    assert "conflicting values" in err and "pass only one" in err
    for n in named:
        assert n in err


def test_alias_and_dotted_agreeing_is_fine():
    cfg = parse_config([*BASE, "--actor.model_name_or_path", "some/model", "--seed", "7", "--train.seed", "7"])
    assert cfg.actor.model_name_or_path == "some/model" and cfg.train.seed == 7


def test_help_lists_sections_in_order(capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    titles = re.findall(r"^(--[a-z.]+\.\*|launcher):", out, re.M)
    assert titles[:2] == ["--actor.*", "--actor.adam.*"]
    top = [t for t in titles if t.count(".") == 1]
    assert top == [f"--{s}.*" for s in ("actor", "ref", "critic", "reward", "data", "rollout", "train", "algo", "ds",
                                         "vllm", "ckpt", "logger", "profile", "precision", "eval")]
    assert "--fp8_unified" in out and "short for --precision.recipe jet_fp8" in out
    assert "(alias: --pretrain)" in out and "[default: 1024]" in out


# ---- validation errors --------------------------------------------------------------------------
@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
def test_group_estimator_needs_several_samples(estimator):
    msg = config_error([*BASE, "--algo.advantage.estimator", estimator])
    assert f"--algo.advantage.estimator {estimator}" in msg
    assert "--rollout.n_samples_per_prompt >= 2 (got 1)" in msg
    cfg = parse_config([*BASE, "--advantage_estimator", estimator, "--n_samples_per_prompt", "4"])
    assert cfg.algo.advantage.estimator == estimator and not cfg.needs_critic and cfg.critic_model_path is None


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--prompt_data", "d.jsonl"], ["--actor.model_name_or_path (alias --pretrain) is required"]),
        (["--pretrain", "m"], ["--data.prompt_dataset (alias --prompt_data) is required"]),
        ([*BASE, "--data.max_len", "0"], ["--data.max_len must be > 0"]),
        ([*BASE, "--max_len", "512", "--max_new_tokens", "512"],
         ["--rollout.max_new_tokens (512) must be smaller than --data.max_len (512)"]),
        ([*BASE, "--rollout.max_new_tokens", "-3"], ["--rollout.max_new_tokens must be > 0"]),
        ([*BASE, "--train.batch_size", "128", "--train.micro_batch_size", "5"],
         ["--train.batch_size (128) must be a multiple of --train.micro_batch_size (5)", "--train.micro_batch_size 4"]),
        ([*BASE, "--rollout.batch_size", "6", "--rollout.n_samples_per_prompt", "2", "--train.batch_size", "8",
          "--train.micro_batch_size", "2"],
         ["6 x 2 = 12 samples per rollout must be a multiple of --train.batch_size (8)", "--train.batch_size 6"]),
        ([*BASE, "--remote_rm_url", "/nonexistent/reward_fn.py"],
         ["--reward.remote_url /nonexistent/reward_fn.py: no such file", "reward_func"]),
        ([*BASE, "--reward.remote_url", "math"], ["neither an http(s) URL nor a .py file"]),
        ([*BASE, "--reward_pretrain", "rm", "--remote_rm_url", "http://h:5000/get_reward"], ["give one reward source"]),
        ([*BASE, "--actor.eps_clip_low_high", "1.2", "0.28"], ["need 0 < LOW < 1 and HIGH > 0, got 1.2 0.28"]),
        ([*BASE, "--actor.eps_clip_low_high", "0.2", "-0.1"], ["need 0 < LOW < 1 and HIGH > 0"]),
        ([*BASE, "--actor.dual_clip", "0.9"], ["--actor.dual_clip must be > 1"]),
        ([*BASE, "--algo.advantage.is_correction_threshold", "5", "0.5"], ["needs 0 <= LOW < HIGH, got 5.0 0.5"]),
        ([*BASE, "--vllm_is_truncated_threshold", "2", "2"], ["needs 0 <= LOW < HIGH"]),
        ([*BASE, "--reward.clip_range", "3", "-3"], ["--reward.clip_range LOW HIGH needs LOW < HIGH"]),
        ([*BASE, "--precision.recipe", "fp9"], ["--precision.recipe fp9", "unknown recipe", "jet_fp8"]),
        ([*BASE, "--precision.recipe", "/nowhere/recipe.yaml"],
         ["--precision.recipe /nowhere/recipe.yaml", "does not exist"]),
        ([*BASE, "--precision.recipe", "fp8_rollout", "--precision.strict"],
         ["--precision.strict refuses an off-policy recipe", "drop --precision.strict or use jet_fp8"]),
        ([*BASE, "--rollout.top_p", "0"], ["--rollout.top_p must be > 0.0"]),
        ([*BASE, "--rollout.top_k", "0"], ["--rollout.top_k 0"]),
        ([*BASE, "--train.micro_batch_size", "0"], ["--train.micro_batch_size must be >= 1"]),
        ([*BASE, "--vllm.gpu_memory_utilization", "1.5"], ["--vllm.gpu_memory_utilization must be <= 1.0"]),
    ],
)
def test_validation_errors(capsys, argv, needles):
    msg = config_error(argv)
    for needle in needles:
        assert needle in msg, (needle, msg)
    err = exit_message(capsys, argv)  # the command line gets the same message, status 2
    assert needles[0] in err


def test_an_unknown_recipe_names_the_recipes_once():
    msg = config_error([*BASE, "--precision.recipe", "fp9"])
    assert msg.count("fp8_rollout") == 1 and "--fp8_unified is jet_fp8" in msg, msg


def test_all_errors_are_listed_at_once():
    msg = config_error(["--algo.advantage.estimator", "rloo", "--data.max_len", "-1"])
    assert msg.startswith("4 configuration errors:")
    for flag in ("--actor.model_name_or_path", "--data.prompt_dataset", "--rollout.n_samples_per_prompt",
                 "--data.max_len"):
        assert flag in msg


def test_remote_reward_sources(tmp_path):
    fn = tmp_path / "my_reward.py"
    fn.write_text("def reward_func(queries, prompts, labels):\n    return [1.0 for _ in queries]\n")
    cfg = parse_config([*BASE, "--remote_rm_url", str(fn)])
    assert cfg.reward.remote_url == str(fn) and cfg.reward_source == "remote"
    assert parse_config([*BASE, "--reward.remote_url", "https://rm.example/score"]).reward_source == "remote"
    assert parse_config([*BASE, "--reward_pretrain", "rm"]).reward_source == "model"
    assert parse_config(BASE).reward_source == "math"


def test_math_reward_without_math_verify_is_refused_before_loading(monkeypatch, tmp_path):
    """The math reward scores any failure 0.0; a missing checker must stop the run, not zero every reward."""
    from openrlhf.trainer import preflight

    assert preflight.preflight_errors(parse_config(BASE)) == []  # math-verify is installed here
    monkeypatch.setattr(preflight, "_has", lambda module: module != "math_verify")
    errors = preflight.preflight_errors(parse_config(BASE))
    assert len(errors) == 1 and "math-verify" in errors[0] and "pip install 'math-verify==0.9.0'" in errors[0]
    fn = tmp_path / "r.py"
    fn.write_text("def reward_func(queries, prompts, labels):\n    return [0.0 for _ in queries]\n")
    assert preflight.preflight_errors(parse_config([*BASE, "--reward.remote_url", str(fn)])) == []


def test_bitwise_keeps_the_invariant_gemm_for_the_policy_only():
    """The reference and the critic are never compared with the engine: in the bitwise mode they take auto's GEMM."""
    cfg = parse_config([*BASE, "--fp8_unified", "--precision.bitwise", "--precision.gemm_backend", "emulated"])
    assert cfg.precision.load_recipe().gemm_backend == "emulated"
    assert cfg.precision.load_recipe(policy=False).gemm_backend == "auto"
    assert cfg.precision.load_recipe(policy=False).train_fprop == cfg.precision.load_recipe().train_fprop
    plain = parse_config([*BASE, "--fp8_unified", "--precision.gemm_backend", "emulated"])
    assert plain.precision.load_recipe(policy=False).gemm_backend == "emulated"  # outside it, one backend for all


def test_kv_cache_flag_sets_the_recipes_and_is_refused_with_bitwise():
    cfg = parse_config([*BASE, "--fp8_unified", "--precision.kv_cache", "e4m3"])
    assert cfg.precision.load_recipe().kv_cache == "e4m3" and cfg.precision.load_recipe(policy=False).kv_cache == "e4m3"
    assert parse_config([*BASE, "--fp8_unified"]).precision.load_recipe().kv_cache == "auto"
    err = config_error([*BASE, "--fp8_unified", "--precision.bitwise", "--precision.kv_cache", "e4m3"])
    assert err.startswith("--precision.bitwise reads the KV cache in the model's dtype") and "kv_cache e4m3" in err


def test_recipe_files(tmp_path):
    from jetrl_precision import get_recipe

    good = tmp_path / "mine.yaml"
    good.write_text(get_recipe("jet_fp8").replace(name="mine").to_yaml())
    cfg = parse_config([*BASE, "--precision.recipe", str(good), "--precision.gemm_backend", "emulated"])
    recipe = cfg.precision.load_recipe()
    assert recipe.name == "mine" and recipe.unified and recipe.gemm_backend == "emulated"

    off = tmp_path / "off.json"
    off.write_text(get_recipe("fp8_rollout").replace(name="off").to_json())
    msg = config_error([*BASE, "--precision.recipe", str(off), "--precision.strict"])
    assert "refuses an off-policy recipe (off" in msg

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\ntrain_fprop:\n  input: {dtype: e4m3}\n")  # e4m3 without granularity
    msg = config_error([*BASE, "--precision.recipe", str(bad)])
    assert f"--precision.recipe {bad}" in msg and "granularity" in msg


def test_validate_checks_types_of_configs_built_in_code():
    cfg = PPOConfig.from_dict({"actor": {"model_name_or_path": "m", "eps_clip": "0.2"},
                               "data": {"prompt_dataset": "d"}, "ds": {"zero_stage": 4}})
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert "--actor.eps_clip must be float, got '0.2'" in str(info.value)
    assert "--ds.zero_stage must be one of 0, 1, 2, 3; got 4" in str(info.value)
    with pytest.raises(ConfigError, match=r"unknown config key actor\.adam\.weight_decy; did you mean .*weight_decay"):
        PPOConfig.from_dict({"actor": {"adam": {"weight_decy": 1e-5}}})


# ---- warnings -----------------------------------------------------------------------------------
def test_fp8_rollout_without_is_correction_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="openrlhf.config.validation"):
        cfg = parse_config([*BASE, "--precision.recipe", "fp8_rollout"])
    assert len(cfg.cfg_warnings) == 1
    w = cfg.cfg_warnings[0]
    for needle in ("off-policy", "x=e4m3[1x128] W=e4m3[128x128]", "x=bf16 W=bf16", "grows with response length",
                   "8k tokens", "--algo.advantage.is_correction_enable --algo.advantage.is_correction_type tis",
                   "--fp8_unified"):
        assert needle in w, needle
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [w]

    for argv in (["--precision.recipe", "fp8_rollout", "--enable_vllm_is_correction"], ["--fp8_unified"], []):
        assert parse_config([*BASE, *argv]).cfg_warnings == ()


def test_vllm_sleep_needs_colocate_all(caplog):
    with caplog.at_level(logging.WARNING, logger="openrlhf.config.validation"):
        cfg = parse_config([*BASE, "--vllm_enable_sleep"])
    assert cfg.vllm.enable_sleep is False
    assert len(cfg.cfg_warnings) == 1
    assert "forced off" in cfg.cfg_warnings[0] and "--train.colocate_all" in cfg.cfg_warnings[0]
    assert any("forced off" in r.getMessage() for r in caplog.records)
    cfg = parse_config([*BASE, "--vllm.enable_sleep", "--colocate_all_models"])
    assert cfg.vllm.enable_sleep is True and cfg.cfg_warnings == ()


# ---- derived values and serialization ------------------------------------------------------------
def test_derived_properties():
    cfg = parse_config(BASE)
    assert cfg.ref_model_path == "some/model" and cfg.critic_model_path == "some/model"
    assert cfg.needs_critic and cfg.needs_ref
    assert cfg.eps_clip_low == cfg.eps_clip_high == 0.2
    assert cfg.ckpt_path == "./ckpt/checkpoints_ppo"

    cfg = parse_config([*BASE, "--ref.model_name_or_path", "ref/m", "--critic_pretrain", "crit/m",
                        "--init_kl_coef", "0",
                        "--eps_clip_low_high", "0.2", "0.28", "--save_path", "/tmp/out", "--eps_clip", "0.1"])
    assert cfg.ref_model_path == "ref/m" and cfg.critic_model_path == "crit/m" and not cfg.needs_ref
    assert (cfg.eps_clip_low, cfg.eps_clip_high) == (0.2, 0.28)
    assert cfg.ckpt_path == "/tmp/out/checkpoints_ppo"
    assert parse_config([*BASE, "--init_kl_coef", "0", "--use_kl_loss"]).needs_ref
    assert parse_config([*BASE, "--ckpt_path", "/c"]).ckpt_path == "/c"


@pytest.mark.parametrize(
    "argv, enabled",
    [([], False), (["--use_wandb", "k"], True), (["--logger.wandb.mode", "offline"], True),
     (["--logger.wandb.key", "k", "--logger.wandb.mode", "disabled"], False),
     (["--logger.wandb.mode", "disabled"], False)],
)
def test_wandb_enabled(argv, enabled):
    assert parse_config([*BASE, *argv]).logger.wandb.enabled is enabled


def test_frozen():
    cfg = parse_config(BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.actor.eps_clip = 0.3  # type: ignore[misc]


def test_to_dict_round_trip():
    cfg = parse_config([*BASE, "--fp8_unified", "--eps_clip_low_high", "0.2", "0.28", "--vllm_enable_sleep",
                        "--algo.kl.target", "0.05", "--rollout.n_samples_per_prompt", "4",
                        "--algo.advantage.estimator", "group_norm"])
    d = cfg.to_dict()
    assert d["actor"]["adam"]["betas"] == [0.9, 0.95] and d["precision"]["recipe"] == "jet_fp8"
    assert d["actor"]["eps_clip_low_high"] == [0.2, 0.28] and len(d["cfg_warnings"]) == 1
    text = yaml.safe_dump(d, sort_keys=False)
    back = PPOConfig.from_dict(yaml.safe_load(text))
    assert back == cfg and back.to_dict() == d


# ---- docs -----------------------------------------------------------------------------------------
def test_docs_tables_are_current():
    text = DOCS.read_text()
    for name, render in (("flags", render_flag_table), ("aliases", render_alias_table), ("parity", render_parity_table)):
        block = re.search(rf"<!-- BEGIN GENERATED: {name} -->\n(.*?)<!-- END GENERATED: {name} -->", text, re.S)
        assert block, name
        assert block.group(1) == render(), "docs/cli.md is stale: run python -m openrlhf.config.docs docs/cli.md"
    flags = render_flag_table()
    assert all(f"`{s.flag}`" in flags for s in flag_specs())


@pytest.mark.parametrize("argv, cache", [([], True), (["--precision.requantize_weights"], False)])
def test_requantize_weights_reaches_every_converter(argv, cache):
    """--precision.requantize_weights: the policy's, the reference's and the critic's FP8 layers keep no quantized
    weights between calls (tests/precision/test_linear.py checks that the bytes are the same)."""
    from openrlhf.trainer.ppo_trainer import PPOTrainer

    cfg = parse_config([*BASE, "--fp8_unified", *argv])
    assert cfg.precision.requantize_weights is (not cache)
    tr = PPOTrainer(cfg, strategy=None, engine_factory=None)
    assert tr.converter.cache_weights is cache and tr.aux_converter.cache_weights is cache
