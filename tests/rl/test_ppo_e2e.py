"""End-to-end GRPO through the real CLI: DeepSpeed (gloo on CPU), the transformers engine,
the precision check, FP8 weight sync with digest checks, and checkpoints."""

import json
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from _rl_helpers import ENV, PY, REPO, free_port, grpo_args, metrics, run

pytestmark = pytest.mark.integration


def _mean(xs):
    return sum(xs) / len(xs)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["jet_fp8", "bf16"])
def test_grpo_deepspeed_zero3_two_ranks_reward_rises(task, tmp_path, recipe):
    model, data = task
    out = tmp_path / recipe
    args = grpo_args(model, data, out, recipe, steps=20, extra=["--ds.zero_stage", "3", "--ckpt.save_steps", "-1"])
    port = free_port()
    run(["deepspeed", "--num_gpus", "2", "--master_port", str(port), "openrlhf/cli/train_ppo_ray.py", *args], timeout=1500)
    # DeepSpeed's CPU allreduce buffers (one /dev/shm file per rank, named by the port) went with the ranks
    assert not sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    hist = metrics(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 20 and summary["engine"] == "hf"
    assert summary["eval_reward_before"] is None  # the evaluation is opt-in (--train.eval_prompts)
    rewards = [h["rollout/reward"] for h in hist]
    print(recipe, [round(r, 3) for r in rewards])
    assert _mean(rewards[-5:]) > _mean(rewards[:5]) + 0.05, rewards
    # Every step logged the rollout-train mismatch from the engine's own logprobs.
    assert all("rollout_train_mismatch/kl_k3" in h and "rollout_train_mismatch/ratio_q50" in h for h in hist)
    mm = max(h["rollout_train_mismatch/abs_logp_diff_mean"] for h in hist)
    assert mm < 1e-2, mm
    assert "precision check: OK" in summary["precision_report"]
    assert any((out / "tb").iterdir())


def test_precision_check_refuses_a_mismatched_engine(task, tmp_path):
    """An on-policy recipe whose engine runs different numerics must not start."""
    from jetrl_precision import FpropSpec, TensorSpec, get_recipe
    from openrlhf.config import parse_config
    from openrlhf.trainer.engines.hf_engine import HFEngine
    from openrlhf.trainer.ppo_trainer import PPOTrainer, PrecisionCheckError
    from openrlhf.utils.deepspeed import DeepspeedStrategy, StrategyConfig

    model, data = task
    cfg = parse_config(grpo_args(model, data, tmp_path / "o", "jet_fp8", 1))
    st = DeepspeedStrategy(StrategyConfig(zero_stage=2, param_dtype="fp32", micro_batch_size=16, train_batch_size=32))
    st.setup_distributed()
    # The engine is built with the pow2-scale variant: a different quantizer on every edge.
    pow2 = get_recipe("jet_fp8").replace(
        rollout=FpropSpec(TensorSpec("e4m3", "1x128", "amax/448,pow2up"), TensorSpec("e4m3", "128x128", "amax/448,pow2up"))
    )
    trainer = PPOTrainer(cfg, st, lambda recipe: HFEngine(str(model), pow2, dtype=torch.float32))
    with pytest.raises(PrecisionCheckError, match="scale_rule"):
        trainer.setup()


@pytest.mark.parametrize("hook", ["on", "off"])
def test_every_optimizer_step_runs_on_fresh_fp8_weights(task, tmp_path, monkeypatch, hook):
    """ZeRO-2 copies optimizer results into the parameters through .data, which torch's version counter
    does not see. The FP8 converter's post_optimizer_hook, run after every applied optimizer step, makes
    the next forward quantize the new weights: actor and critic, 4 optimizer steps per rollout here.
    With the hook disabled the same run must see stale FP8 weights (the check can fail)."""
    from jetrl_precision import Fp8Converter, fp8_linears, ops
    from openrlhf.config import parse_config
    from openrlhf.trainer.ppo_trainer import PPOTrainer
    from openrlhf.trainer.run import make_engine_factory, make_strategy

    if hook == "off":
        monkeypatch.setattr(Fp8Converter, "post_optimizer_hook", lambda self, model: None)
    model, data = task
    extra = ["--ds.zero_stage", "2", "--algo.advantage.estimator", "gae", "--ckpt.save_steps", "0"]
    cfg = parse_config(grpo_args(model, data, tmp_path / "o", "jet_fp8", 1, extra))
    st = make_strategy(cfg)
    st.setup_distributed()
    trainer = PPOTrainer(cfg, st, make_engine_factory(cfg, st))
    trainer.setup()
    layers = {**fp8_linears(trainer.actor.model), **{f"critic.{n}": m for n, m in fp8_linears(trainer.critic_engine.module).items()}}
    assert len(layers) == 2 * 14
    before = {n: m.weight.detach().clone() for n, m in layers.items()}
    seen: dict[str, list[bool]] = {}

    def check(module, args):
        fresh = ops.quantize(module.weight.detach(), module.fprop.weight)
        seen.setdefault(module.fqn, []).append(torch.equal(module.quantized_weight().data.view(torch.uint8), fresh.data.view(torch.uint8)))

    handles = [m.register_forward_pre_hook(check) for m in layers.values()]
    trainer.step()
    for h in handles:
        h.remove()
    trainer.close()
    assert trainer.updates_per_rollout == 4
    assert all(not torch.equal(before[n], m.weight.detach()) for n, m in layers.items())  # every layer trained
    forwards = [ok for oks in seen.values() for ok in oks]
    assert len(forwards) >= 4 * len(layers)
    if hook == "on":
        assert all(forwards), f"{forwards.count(False)} of {len(forwards)} FP8 forwards ran on stale weights"
    else:
        assert forwards.count(False) >= 3 * len(layers)


@pytest.mark.slow
def test_resume_after_kill_matches_uninterrupted_run(task, tmp_path):
    model, data = task
    full, killed = tmp_path / "full", tmp_path / "killed"
    steps = 4
    # The uninterrupted run goes beside the killed one (independent runs, one thread per op each: the same results).
    with ThreadPoolExecutor(1) as pool:
        full_run = pool.submit(run, [PY, "-m", "openrlhf.cli.train_ppo_ray", *grpo_args(model, data, full, "jet_fp8", steps, ["--ckpt.save_steps", "1"])])

        # Start the same run, SIGKILL it once the step-2 checkpoint is complete (DeepSpeed writes
        # `latest` last), then resume.
        args = grpo_args(model, data, killed, "jet_fp8", steps, ["--ckpt.save_steps", "1"])
        proc = subprocess.Popen([PY, "-m", "openrlhf.cli.train_ppo_ray", *args], cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        latest = killed / "checkpoints_ppo" / "actor" / "latest"
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None:
            if latest.exists() and latest.read_text().strip() in ("global_step2", "global_step3"):
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.2)
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
        killed_at = int(latest.read_text().strip()[len("global_step"):])
        assert not (killed / "summary.json").exists()

        run([PY, "-m", "openrlhf.cli.train_ppo_ray", *args, "--ckpt.load_enable"])
        full_run.result()
    resumed = metrics(killed)
    ref = metrics(full)
    # The resumed run continues at the saved step with the same data position, optimizer state and
    # seeds, on one thread, with the same ops on the same shapes: deterministic by construction, so
    # its steps reproduce the uninterrupted run's bit for bit.
    assert [h["step"] for h in resumed] == list(range(killed_at + 1, steps + 1))
    for a, b in zip(resumed, ref[killed_at:]):
        assert a["step"] == b["step"]
        assert a["rollout/reward"] == b["rollout/reward"]
        assert a["train/policy_loss"] == b["train/policy_loss"]

    def final_state(root):
        from pathlib import Path

        d = Path(root) / "checkpoints_ppo" / "actor" / f"global_step{steps}"
        opt = torch.load(next(d.glob("*optim_states.pt")), map_location="cpu", weights_only=False)
        mdl = torch.load(next(d.glob("*model_states.pt")), map_location="cpu", weights_only=False)
        return opt, mdl

    (opt_a, mdl_a), (opt_b, mdl_b) = final_state(full), final_state(killed)
    assert mdl_a["global_step"] == mdl_b["global_step"]
    assert mdl_a["rollout_index"] == mdl_b["rollout_index"] and mdl_a["episode"] == mdl_b["episode"]
    sa = opt_a["optimizer_state_dict"]["base_optimizer_state"]["state"]
    sb = opt_b["optimizer_state_dict"]["base_optimizer_state"]["state"]
    for k in sa:
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[k][name], sb[k][name]), (k, name)
    for k in mdl_a["module"]:
        assert torch.equal(mdl_a["module"][k], mdl_b["module"][k]), k


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--algo.advantage.estimator", "group_norm"], "n_samples_per_prompt"),
        (["--actor.lr", "1e-6"], "did you mean --actor.adam.lr"),
        (["--precision.recipe", "no_such_recipe"], "recipe"),
        (["--precision.recipe", "bf16", "--fp8_unified"], "--fp8_unified"),
    ],
)
def test_cli_errors_are_clear(task, tmp_path, argv, needle):
    model, data = task
    base = ["--actor.model_name_or_path", str(model), "--data.prompt_dataset", str(data)]
    proc = run([PY, "-m", "openrlhf.cli.train_ppo_ray", *base, *argv], timeout=120, check=False)
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "extra,needles",
    [
        (["--data.input_key", "question"], ["--data.input_key", "question"]),
        (["--rollout.batch_size", "4096", "--train.batch_size", "4096"], ["fewer than --rollout.batch_size"]),
        (["--rollout.engine", "vllm", "--data.max_len", "100000", "--rollout.max_new_tokens", "4"], ["--data.max_len 100000", "positions"]),
    ],
)
def test_setup_errors_are_clear(task, tmp_path, extra, needles):
    model, data = task
    proc = run([PY, "-m", "openrlhf.cli.train_ppo_ray", *grpo_args(model, data, tmp_path / "o", "bf16", 1, extra)], timeout=300, check=False)
    assert proc.returncode == 1
    assert all(n in proc.stderr for n in needles), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_optional_training_flags_run(task, tmp_path):
    """Entropy bonus, reward normalization, Dr.GRPO, offloaded reference, fp32 grad accumulation."""
    model, data = task
    out = tmp_path / "flags"
    extra = [
        "--actor.entropy_coef", "0.01", "--reward.normalize_enable", "--algo.advantage.estimator", "dr_grpo",
        "--algo.kl.init_coef", "0.01", "--algo.kl.use_loss", "--algo.kl.estimator", "k3", "--ref.offload",
        "--ds.grad_accum_dtype", "fp32", "--ckpt.save_steps", "-1", "--train.eval_prompts", "8", "--eval_n_samples_per_prompt", "2",
    ]
    args = grpo_args(model, data, out, "jet_fp8", 2, extra)
    run([PY, "-m", "openrlhf.cli.train_ppo_ray", *args], timeout=600)
    hist = metrics(out)
    assert len(hist) == 2
    summary = json.loads((out / "summary.json").read_text())
    # Opted in: the sampled reward on the first 8 prompts, before and after.
    assert all(0.0 <= summary[k] <= 1.0 for k in ("eval_reward_before", "eval_reward_after"))
    assert all(h["train/entropy"] > 0 and "train/kl_loss" in h for h in hist)
    # Normalized rewards feed the advantages; the logged task reward stays the raw 0/1 score.
    assert all(0.0 <= h["rollout/reward"] <= 1.0 for h in hist)


@pytest.mark.slow
def test_torchrun_launch_two_ranks(task, tmp_path):
    model, data = task
    out = tmp_path / "torchrun"
    args = grpo_args(model, data, out, "jet_fp8", 2, ["--ds.zero_stage", "3", "--ckpt.save_steps", "-1"])
    run(["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "openrlhf.cli.train_ppo_ray", *args], timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2
    assert "precision check: OK" in summary["precision_report"]


def test_hf_export_under_zero3_loads_and_holds_the_trained_weights(task, tmp_path):
    from transformers import AutoModelForCausalLM

    model, data = task
    out = tmp_path / "export"
    args = grpo_args(model, data, out, "jet_fp8", 1, ["--ds.zero_stage", "3", "--ckpt.save_hf", "--ckpt.save_steps", "1"])
    run([PY, "-m", "openrlhf.cli.train_ppo_ray", *args], timeout=600)
    exported = AutoModelForCausalLM.from_pretrained(out / "checkpoints_ppo" / "hf" / "global_step1")
    initial = AutoModelForCausalLM.from_pretrained(model)
    moved = [n for (n, a), (_, b) in zip(exported.named_parameters(), initial.named_parameters()) if not torch.equal(a, b)]
    assert len(moved) > 0  # four optimizer steps changed the weights; the export carries them, not the init
    # ...and only as far as four Adam steps can: each moves a weight by at most its lr (betas 0.9/0.95: 1 - beta1 <
    # sqrt(1 - beta2)), and the lr never exceeds --actor.adam.lr 3e-4. A wrongly keyed export would load fresh weights.
    for (n, a), (_, b) in zip(exported.named_parameters(), initial.named_parameters()):
        assert (a - b).abs().max() <= 4 * 3e-4 * (1 + 1e-3), n
