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

from openrlhf.config import flag_specs, parse_config, parse_unvalidated

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
