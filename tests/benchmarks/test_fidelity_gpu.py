"""benchmarks/fidelity_gpu.py end to end on CPU (`all --tiny`): the mismatch study (4 rows, each in its own process),
GRPO learning runs through the real CLI under the deepspeed launcher, the long-rollout comparison, and the report
(run records, plots, headline figures). The H200 calls (benchmarks/h200_fidelity.sh) run the same code at full size.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import headline  # noqa: E402
from _rl_helpers import ENV  # noqa: E402

# One xdist worker runs the module (`make test` runs --dist loadgroup): every test reads the `study` fixture, which
# a second worker would run again.
pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.xdist_group("fidelity_gpu_study")]
ROWS = ("bf16", "fp8_rollout", "jet_fp8", "jet_fp8+bitwise")
LEARN = ("bf16", "jet_fp8", "fp8_rollout")
LENGTHS = (32, 64, 128)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    d = tmp_path_factory.mktemp("fidelity")
    proc = subprocess.run(
        [sys.executable, "benchmarks/fidelity_gpu.py", "all", "--tiny", "--runs", *LEARN, "--out", str(d / "out"),
         "--workdir", str(d / "work"), "--runs_dir", str(d / "runs"), "--docs_dir", str(d / "docs")],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = d / "out"
    mismatch = {m["row"]: m for m in json.loads((out / "mismatch.json").read_text())}
    runs = {(p.name.split("_", 1)[0], p.stem.split("_", 1)[1]): json.loads(p.read_text())
            for p in out.glob("*_s0.json") if p.name.startswith(("learn_", "long_"))}
    (run_file,) = (d / "runs").glob("*.json")
    return d, mismatch, runs, json.loads(run_file.read_text()), proc.stdout


def test_mismatch_by_length_and_position(study):
    _, mismatch, _, _, _ = study
    assert set(mismatch) == set(ROWS)
    for row, m in mismatch.items():
        assert m["available"], (row, m.get("reason"))
        assert [int(k) for k in m["lengths"]] == list(LENGTHS)
        for asked, L in m["lengths"].items():
            # ignore_eos: every rollout runs to the length asked, and the position buckets cover all its tokens
            assert L["new_tokens"] == int(asked) and L["tokens"] == L["sequences"] * int(asked) == 4 * int(asked), (row, asked)
            bp = L["by_position"]
            assert sum(bp["tokens"]) == L["tokens"] and bp["start"] == list(range(0, int(asked), 16))
            assert all(p >= a >= 0 for a, p in zip(bp["abs_mean"], bp["abs_p99"]))
            assert L["overall"]["abs_logp_diff_p99"] <= L["overall"]["abs_logp_diff_max"]
    for asked in map(str, LENGTHS):
        mean = {row: m["lengths"][asked]["overall"]["abs_logp_diff_mean"] for row, m in mismatch.items()}
        # batch-invariant numerics: the engine's logprobs are the trainer's, bit for bit
        assert mean["jet_fp8+bitwise"] == 0.0 and max(mismatch["jet_fp8+bitwise"]["lengths"][asked]["by_position"]["abs_p99"]) == 0.0
        # FP8 rollout against a full-precision trainer is off-policy by construction
        assert mean["fp8_rollout"] > 10 * max(mean["bf16"], mean["jet_fp8"]), (asked, mean)
    assert mismatch["jet_fp8+bitwise"]["engine"] == "hf"  # auto: vLLM's bitwise mode is CUDA only


def test_learning_runs_log_what_the_study_compares(study):
    d, _, runs, _, _ = study
    assert set(runs) == {("learn", r + "_s0") for r in LEARN} | {("long", r + "_s0") for r in ("fp8_rollout", "jet_fp8")}
    for (part, name), res in runs.items():
        assert res["rc"] == 0 and not res["timed_out"] and [s["step"] for s in res["steps"]] == [1, 2], (part, name, res.get("log_tail"))
        cmd = json.loads((d / "out" / part / name / "cmd.json").read_text())
        assert "openrlhf/cli/train_ppo_ray.py" in cmd[cmd.index("--num_gpus") + 4] and cmd[cmd.index("--train.seed") + 1] == "0"
        assert ("--fp8_unified" in cmd) == name.startswith("jet_fp8")
        assert "--algo.advantage.is_correction_enable" not in cmd  # fp8_rollout here is the uncorrected baseline
        for s in res["steps"]:
            assert math.isfinite(s["train/grad_norm"]) and s["train/grad_norm_max"] >= s["train/grad_norm"] >= 0
            if 0 < s["rollout/reward"] < 1:  # some group's rewards differ: GRPO advantages, so a policy gradient
                assert s["train/grad_norm"] > 0, (part, name, s["step"])
            assert "rollout_train_mismatch/abs_logp_diff_mean" in s
        last = res["steps"][-1]
        assert 0 <= last["eval/pass1"] <= 1 and last["eval/pass1_resample_std"] >= 0
    # the held-out set is not the training set
    train = (d / "work" / "learn_train.jsonl").read_text().splitlines()
    heldout = (d / "work" / "learn_heldout.jsonl").read_text().splitlines()
    assert not {json.loads(x)["input"] for x in heldout} & {json.loads(x)["input"] for x in train}
    # the long runs: the learn task, every rollout sampled to its full length past EOS, the first answer rewarded
    cmd = json.loads((d / "out" / "long" / "jet_fp8_s0" / "cmd.json").read_text())
    assert "--rollout.ignore_eos" in cmd and cmd[cmd.index("--reward.remote_url") + 1].endswith("benchmarks/first_answer_reward.py")
    long_tokens = int(cmd[cmd.index("--rollout.max_new_tokens") + 1])
    for (part, name), res in runs.items():
        if part == "long":
            assert all(s["rollout/response_length"] == long_tokens for s in res["steps"]), name


def test_records_plots_and_headline_figures(study):
    d, mismatch, runs, records, stdout = study
    for r in records:
        for key in ("name", "shape", "backend", "unit", "command", "date", "device"):
            assert isinstance(r[key], str) and r[key], (key, r)
        assert isinstance(r["value"], (int, float)) and "ratio_vs_bf16" in r
    by = {(r["name"], r["backend"]): r for r in records}
    pass1 = {name.rsplit("_", 1)[0]: res["steps"][-1]["eval/pass1"] for (part, name), res in runs.items() if part == "learn"}
    for recipe in ("jet_fp8", "fp8_rollout"):
        gap = by[("grpo_eval_gap_vs_bf16_pp", recipe)]
        assert gap["value"] == pytest.approx(100 * (pass1[recipe] - pass1["bf16"]), abs=0.01) and gap["at_step"] == 2
        assert gap["spread_is"] == "standard error from the eval resamples" and gap["spread_pp"] >= 0
    long_pass1 = {name.rsplit("_", 1)[0]: res["steps"][-1]["eval/pass1"] for (part, name), res in runs.items() if part == "long"}
    assert by[("grpo_long_eval_gap_vs_jet_fp8_pp", "fp8_rollout")]["value"] == pytest.approx(
        100 * (long_pass1["fp8_rollout"] - long_pass1["jet_fp8"]), abs=0.01)
    mm = by[("fidelity_mismatch_abs_logp_mean", "fp8_rollout")]
    assert mm["rollout_tokens"] in LENGTHS and mm["value"] == mismatch["fp8_rollout"]["lengths"][str(mm["rollout_tokens"])]["overall"]["abs_logp_diff_mean"]
    curve = by[("fidelity_learn_mismatch_abs_logp_mean", "jet_fp8_s0")]["grad_norm_curve"]
    assert curve == [s["train/grad_norm"] for s in runs[("learn", "jet_fp8_s0")]["steps"]]
    fresh = headline.compute_headline(headline.load_records(d / "runs"))["metrics"]
    assert fresh["grpo_eval_gap_jet_fp8_vs_bf16_pct"]["value"] == pytest.approx(by[("grpo_eval_gap_vs_bf16_pp", "jet_fp8")]["value"], abs=0.01)
    assert fresh["grpo_eval_gap_fp8_rollout_vs_bf16_pct"]["value"] == pytest.approx(by[("grpo_eval_gap_vs_bf16_pp", "fp8_rollout")]["value"], abs=0.01)
    for png in ("fidelity_mismatch.png", "fidelity_learning.png", "fidelity_long.png"):
        data = (d / "docs" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, png
    assert "| jet_fp8+bitwise | 0 / 0 / 0 |" in stdout and "vs jet_fp8 (pp)" in stdout


def test_a_refused_bitwise_row_is_reported_with_its_reason(study, tmp_path):
    """Where batch-invariant kernels are missing (any non-CPU device today) the row stays in the report, saying why."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from jetrl_precision.batch_invariant import BitwiseUnavailable, make_batch_invariant

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                             num_key_value_heads=1, vocab_size=128))
    with pytest.raises(BitwiseUnavailable) as refused:
        make_batch_invariant(model)
    d, mismatch, _, _, _ = study
    out = tmp_path / "res"
    out.mkdir()
    rows = [m for r, m in mismatch.items() if r != "jet_fp8+bitwise"]
    rows.append({**{k: mismatch["jet_fp8+bitwise"][k] for k in ("part", "row", "recipe", "bitwise", "engine", "model")},
                 "available": False, "reason": str(refused.value)})
    (out / "mismatch.json").write_text(json.dumps(rows))
    (out / "env.json").write_text(next(Path(d).rglob("env.json")).read_text())  # the machine the rows ran on
    proc = subprocess.run([sys.executable, "benchmarks/fidelity_gpu.py", "report", "--from", str(out), "--runs_dir", str(tmp_path / "runs"),
                           "--docs_dir", str(tmp_path / "docs")], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"| jet_fp8+bitwise | not available: {refused.value} |" in proc.stdout
    (run_file,) = (tmp_path / "runs").glob("*.json")
    (row,) = [r for r in json.loads(run_file.read_text()) if r["name"] == "fidelity_mismatch_row_available"]
    assert row["backend"] == "jet_fp8+bitwise" and row["value"] == 0 and row["reason"] == str(refused.value)


def test_the_device_call_plan_parses_and_names_its_stages():
    script = ROOT / "benchmarks" / "h200_fidelity.sh"
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = script.read_text()
    for stage in ("prepare", "unpack", "install", "smollm2", "mismatch", "learn", "long"):
        assert f"stage_{stage}()" in text, stage
