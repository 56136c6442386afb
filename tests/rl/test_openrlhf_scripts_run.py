"""OpenRLHF v0.11 example scripts, shrunk to a CPU, run 2 steps with the flags they use.

Each script's argv (tests/rl/fixtures/openrlhf_v0_11.json) keeps its feature flags (packing, dynamic
batching, DAPO filtering, DeepSpeed sleep, agent, periodic eval, IS correction, clip-higher, ZeRO
stage, GAE critic, reward normalization, ...) plus `--fp8_unified`; what cannot fit this machine is
replaced: model and data paths (a tiny local model and arithmetic prompts), sizes, flash attention
(sdpa), and wandb. One SPMD process (the Ray placement flags are parsed, then unused). Scripts using
GPU-only or refused features are checked to stop with one clear line instead.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from _rl_helpers import ENV, PY, REPO, make_reward_model, metrics
from test_openrlhf_parity_cli import SCRIPTS

pytestmark = pytest.mark.integration

SIZE = {
    "--rollout.batch_size": "4", "--rollout.n_samples_per_prompt": "4", "--train.batch_size": "8",
    "--train.micro_batch_size": "4", "--rollout.micro_batch_size": "8", "--data.max_len": "40",
    "--rollout.max_new_tokens": "6", "--train.max_tokens_per_gpu": "48", "--rollout.max_tokens_per_gpu": "64",
    "--data.max_samples": "64", "--ds.param_dtype": "fp32", "--ds.attn_implementation": "sdpa",
    "--data.input_key": "input", "--data.label_key": "label", "--train.num_episodes": "1",
    "--eval.n_samples_per_prompt": "2",
}
DROP_SWITCHES = {"--data.apply_chat_template"}  # the tiny char tokenizer has no chat template
DROP_VALUES = {"--logger.wandb.key", "--ds.ring_attn_size", "--ds.ring_attn_head_stride"}

REWARD = "def reward_func(queries, prompts, labels):\n    return [float(l in q[len(p):]) for q, p, l in zip(queries, prompts, labels)]\n"
AGENT = '''
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def step(self, states, **kwargs):
        self.turn += 1
        ok = float(states["label"] in states["action_text"])
        done = ok > 0 or self.turn >= 2
        return {"rewards": ok, "scores": ok, "environment_feedback": "" if done else " no, again:", "done": done}

class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from openrlhf.datasets.synthetic import make_arithmetic_records, write_jsonl
    from openrlhf.utils.tiny_model import TinyModelSpec, build_tiny_model

    d = tmp_path_factory.mktemp("scripts")
    write_jsonl(make_arithmetic_records(64, difficulty=1, seed=0, max_operand=4, operators=("+",)), d / "train.jsonl")
    write_jsonl(make_arithmetic_records(6, difficulty=1, seed=1, max_operand=4, operators=("+",)), d / "eval.jsonl")
    (d / "reward.py").write_text(REWARD)
    (d / "agent.py").write_text(AGENT)
    model = build_tiny_model(d / "model", TinyModelSpec(num_hidden_layers=1))
    return {"dir": d, "model": str(model), "reward_model": str(make_reward_model(model, d / "reward_model")),
            "data": str(d / "train.jsonl"), "eval": str(d / "eval.jsonl"), "reward": str(d / "reward.py"), "agent": str(d / "agent.py")}


def shrink(argv: list[str], w: dict, out) -> list[str]:
    paths = {
        "--actor.model_name_or_path": w["model"], "--reward.model_name_or_path": w["reward_model"],
        "--data.prompt_dataset": w["data"], "--eval.dataset": w["eval"], "--train.agent_func_path": w["agent"],
        "--reward.remote_url": w["reward"], "--ckpt.output_dir": str(out), "--ckpt.path": str(out / "ckpt"),
        "--logger.tensorboard_dir": str(out / "tb"),
    }
    result, i = [], 0
    while i < len(argv):
        flag = argv[i]
        takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        value = argv[i + 1] if takes_value else None
        if flag == "--algo.dynamic_filtering_range" or flag == "--actor.eps_clip_low_high" or flag == "--algo.advantage.is_correction_threshold":
            result += argv[i : i + 3]
            i += 3
            continue
        i += 2 if takes_value else 1
        if flag in DROP_SWITCHES or flag in DROP_VALUES:
            continue
        if flag in paths:
            value = paths[flag]
        elif flag in SIZE:
            value = SIZE[flag]
        elif flag == "--eval.steps" and "--eval.dataset" in argv:
            value = "1"  # evaluate within the 2 steps
        result += [flag] + ([value] if value is not None else [])
    for flag, value in {**SIZE, "--ckpt.output_dir": str(out)}.items():
        if flag not in result:
            result += [flag, value]
    if "--eval.dataset" in result:
        result += ["--eval.steps", "1"] if "--eval.steps" not in result else []
    return result + ["--rollout.engine", "hf", "--train.max_steps", "4", "--ckpt.save_steps", "-1", "--fp8_unified"]


def _run(argv):
    import subprocess

    # DeepSpeed's JIT-built ops (its CPU allreduce, CPUAdam for --ds.adam_offload) come from the suite's extensions
    # cache (tests/conftest.py): each is built once per interpreter, not again per test module.
    env = {**ENV, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    try:
        return subprocess.run([PY, "-m", "openrlhf.cli.train_ppo_ray", *argv], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-3000:]
        pytest.fail(f"run did not finish in 600 s; stderr tail:\n{tail.decode(errors='replace') if isinstance(tail, bytes) else tail}")


RUNS = ["train_dapo_ray_hybrid_engine.sh", "train_ppo_ray_hybrid_engine.sh", "train_prorlv2_math_hybrid_engine.sh",
        "train_reinforce_baseline_hybrid_engine.sh", "train_ppo_with_reward_fn.sh", "train_ppo_ray_slurm.sh"]


@pytest.fixture(scope="module")
def script_runs(world, tmp_path_factory, request):
    """The selected scripts of RUNS, two at a time (each run is one process running its ops on one thread): name ->
    (argv, output folder, finished process). The first run with --ds.adam_offload JIT-builds DeepSpeed's CPUAdam; the
    other runs go on meanwhile."""
    selected = {item.callspec.params["name"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_script_runs_two_steps"}
    root = tmp_path_factory.mktemp("script_runs")
    argvs = {name: shrink(SCRIPTS[name], world, root / name / "out") for name in RUNS if name in selected}

    def run_or_fail(argv):  # a run's failure is its own test's, not every test's
        try:
            return _run(argv)
        except BaseException as e:  # noqa: BLE001 - pytest.fail's Failed included; re-raised in the test
            return e

    first = sorted(argvs, key=lambda name: "--ds.adam_offload" not in argvs[name])[:1]  # the build overlaps the rest
    order = first + [name for name in argvs if name not in first]
    with ThreadPoolExecutor(2) as pool:
        procs = dict(zip(order, pool.map(run_or_fail, [argvs[name] for name in order])))
    return {name: (argvs[name], root / name / "out", procs[name]) for name in argvs}


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_script_runs_two_steps(name, script_runs):
    argv, out, proc = script_runs[name]
    if isinstance(proc, BaseException):
        raise proc
    assert proc.returncode == 0, proc.stderr[-3000:]
    hist = metrics(out)
    assert [h["step"] for h in hist] == [1, 2], hist
    summary = json.loads((out / "summary.json").read_text())
    assert summary["recipe"] == "jet_fp8" and "precision check: OK" in summary["precision_report"]
    if "--algo.dynamic_filtering_enable" in argv:
        assert all(0 < h["rollout/filter_pass_rate"] <= 1 and h["rollout/filter_rounds"] >= 1 for h in hist), hist
    if "--eval.dataset" in argv:
        assert all("eval/pass1" in h and "eval/pass2" in h for h in hist)
    if "--train.agent_func_path" in argv:
        assert all(h["rollout/response_length"] > 0 for h in hist)
    if "--actor.entropy_coef" in argv:  # 0.0 in the script: the entropy is logged, no bonus
        assert all(h["train/entropy"] > 0 for h in hist)
    if "--reward.stop_properly_penalty_coef" in argv:
        assert all("rollout/truncated" in h for h in hist)


@pytest.mark.parametrize("name,needle", [
    ("train_reinforce_baseline_ray_agent_async.sh", "--train.async_enable"),
    ("train_vlm_math_hybrid_engine.sh", "vision-language"),
])
def test_refused_scripts_stop_with_one_line(name, needle, world, tmp_path):
    argv = shrink(SCRIPTS[name], world, tmp_path / "o")
    proc = _run(argv)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_ring_attention_is_refused_naming_what_is_missing(world, tmp_path):
    argv = shrink(SCRIPTS["train_reinforce_baseline_hybrid_engine.sh"], world, tmp_path / "o") + ["--ds.ring_attn_size", "2", "--ds.ring_attn_head_stride", "2"]
    proc = _run(argv)
    assert proc.returncode == 2 and "ring-flash-attn" in proc.stderr and "CUDA" in proc.stderr, proc.stderr[-2000:]
