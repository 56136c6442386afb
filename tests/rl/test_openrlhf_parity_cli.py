"""OpenRLHF v0.11 users bring their scripts: every PPO/GRPO/REINFORCE++/DAPO example script parses
with `--fp8_unified` appended, and every flag of v0.11's train_ppo_ray is known to our parser.

The argument lists come from tests/rl/fixtures/openrlhf_v0_11.json (data only: flag names and values).
File arguments the scripts point at (/openrlhf/examples/python/reward_func.py, an agent file) are
redirected to real local files, because validation checks that they exist.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openrlhf.config import OPENRLHF_V0_11, ConfigError, flag_specs, parse_config, parse_unvalidated

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "openrlhf_v0_11.json").read_text())
SCRIPTS = FIXTURE["scripts"]
VARIANTS = [(name, extra) for name, extras in FIXTURE["commented_variants"].items() for extra in extras]
REF_FLAGS = FIXTURE["flags"]


@pytest.fixture(scope="module")
def local_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("user_files")
    reward = d / "reward_func.py"
    reward.write_text("def reward_func(queries, prompts, labels):\n    return [0.0 for _ in queries]\n")
    agent = d / "agent_func.py"
    agent.write_text(
        "from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor\n"
        "class AgentInstance(AgentInstanceBase):\n"
        "    def __init__(self, *a, **k): pass\n"
        "    async def step(self, states, **k):\n"
        "        return {'rewards': 0.0, 'environment_feedback': '', 'done': True}\n"
        "class AgentExecutor(MultiTurnAgentExecutor):\n"
        "    def __init__(self):\n"
        "        super().__init__(AgentInstance)\n"
    )
    return {"reward": str(reward), "agent": str(agent)}


def localize(argv: list[str], files: dict[str, str]) -> list[str]:
    """The script's argv with its .py file arguments pointing at local files."""
    out = []
    for prev, arg in zip([None, *argv], argv):
        if prev == "--train.agent_func_path":
            arg = files["agent"]
        elif prev == "--reward.remote_url" and arg.endswith(".py"):
            arg = files["reward"]
        out.append(arg)
    return out


def test_fixture_holds_the_v0_11_scripts():
    assert len(SCRIPTS) == 8 and len(REF_FLAGS) == 164
    assert all("--actor.model_name_or_path" in argv for argv in SCRIPTS.values())


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_parses_with_fp8_unified(name, local_files):
    argv = localize(SCRIPTS[name], local_files) + ["--fp8_unified"]
    cfg = parse_config(argv, exit_on_error=False)
    assert cfg.precision.recipe == "jet_fp8"
    assert cfg.actor.model_name_or_path == SCRIPTS[name][SCRIPTS[name].index("--actor.model_name_or_path") + 1]


@pytest.mark.parametrize("name,extra", VARIANTS, ids=[f"{n}+{' '.join(e)}" for n, e in VARIANTS])
def test_commented_variants_parse(name, extra, local_files):
    parse_config(localize(SCRIPTS[name], local_files) + extra + ["--fp8_unified"], exit_on_error=False)


OURS = {s.flag: s for s in flag_specs()}


def _sample_argv(ref: dict) -> list[str]:
    """The flag with a value of its type (the first choice, when v0.11 or we list choices)."""
    if ref["kind"] != "value":
        return [ref["flag"]]
    if "choices" in ref:
        value = str(ref["choices"][0])
    elif ref["flag"] in OURS and OURS[ref["flag"]].choices is not None:
        value = str(OURS[ref["flag"]].choices[0])
    else:
        value = {"int": "2", "float": "0.5", "str": "x"}[ref["type"]]
    nargs = ref.get("nargs", 1)
    return [ref["flag"], *([value] * (2 if nargs == "*" else nargs))]


@pytest.mark.parametrize("ref", REF_FLAGS, ids=[r["flag"] for r in REF_FLAGS])
def test_every_v0_11_flag_is_known(ref):
    """Each flag of v0.11's parser is accepted by ours, with a value of the same type and arity."""
    parse_unvalidated(_sample_argv(ref))


def test_v0_11_choices_are_accepted():
    ours = {s.flag: s for s in flag_specs()}
    for ref in REF_FLAGS:
        if "choices" in ref and ref["flag"] in ours and ours[ref["flag"]].choices is not None:
            missing = set(ref["choices"]) - {str(c) for c in ours[ref["flag"]].choices}
            assert not missing, f"{ref['flag']} lacks v0.11 choices {missing}"


# ---- docs/cli.md's parity table: every v0.11 flag, and every refusal real ----------------------------
def test_parity_table_lists_exactly_the_v0_11_flags_in_order():
    assert list(OPENRLHF_V0_11) == [r["flag"] for r in REF_FLAGS]
    assert set(OPENRLHF_V0_11) <= set(OURS)
    for flag, p in OPENRLHF_V0_11.items():
        assert p.status in ("supported", "differs", "refused"), flag
        assert p.note or p.status == "supported", f"{flag}: say how it differs or why it is refused"
    rendered = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    assert all(f"| `{flag}` |" in rendered for flag in OPENRLHF_V0_11)


# What turns each refused flag on (a sub-flag of a refused feature is refused through its parent).
REFUSAL_TRIGGERS = {
    "--train.async_enable": ["--train.async_enable"],
    "--train.async_queue_size": ["--train.async_enable", "--train.async_queue_size", "4"],
    "--train.partial_rollout_enable": ["--train.partial_rollout_enable"],
    "--ds.deepcompile": ["--ds.deepcompile"],
    "--ds.tensor_parallel_size": ["--ds.tensor_parallel_size", "2"],
    "--ds.load_in_4bit": ["--ds.load_in_4bit"],
    "--ds.lora.rank": ["--ds.lora.rank", "8"],
    "--ds.lora.alpha": ["--ds.lora.rank", "8", "--ds.lora.alpha", "32"],
    "--ds.lora.target_modules": ["--ds.lora.rank", "8", "--ds.lora.target_modules", "q_proj"],
    "--ds.lora.dropout": ["--ds.lora.rank", "8", "--ds.lora.dropout", "0.1"],
    "--actor.aux_loss_coef": ["--actor.aux_loss_coef", "0.01"],
    "--actor.optim": ["--actor.optim", "muon"],
    **{f"--actor.muon.{k}": ["--actor.optim", "muon"] for k in ("lr", "momentum", "ns_steps", "nesterov", "no_nesterov")},
    "--critic.optim": ["--critic.optim", "muon"],
    **{f"--critic.muon.{k}": ["--critic.optim", "muon"] for k in ("lr", "momentum", "ns_steps", "nesterov", "no_nesterov")},
    "--ds.ring_attn_size": ["--ds.ring_attn_size", "2"],
    "--ds.ring_attn_head_stride": ["--ds.ring_attn_size", "2", "--ds.ring_attn_head_stride", "2"],
    "--data.image_key": ["--data.max_images_per_prompt", "1", "--data.image_key", "images"],
    "--data.max_images_per_prompt": ["--data.max_images_per_prompt", "1"],
    "--actor.freeze_visual_encoder": ["--actor.freeze_visual_encoder"],
    "--use_ms": ["--use_ms"],
}


def test_every_refused_flag_has_a_trigger():
    assert set(REFUSAL_TRIGGERS) == {f for f, p in OPENRLHF_V0_11.items() if p.status == "refused"}


@pytest.mark.parametrize("flag", sorted(REFUSAL_TRIGGERS))
def test_refused_flags_are_refused_in_one_line_naming_them(flag):
    """Before anything loads (the CLI prints these and exits 2); each line names the flag that turned the feature on."""
    from openrlhf.trainer.preflight import preflight_errors

    argv = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "d.jsonl", *REFUSAL_TRIGGERS[flag]]
    try:
        errors = preflight_errors(parse_config(argv, exit_on_error=False), cuda=False)
    except ConfigError as e:
        errors = [str(e)]
    parent = REFUSAL_TRIGGERS[flag][0]
    named = [e for e in errors if parent in e]
    assert named and all("\n" not in e for e in named), errors
