"""Benchmark results: the raw run records are complete and typed, the goals table reads them, headline.json is
what the records say, the README quotes headline.json, and gpu_bench's CPU-runnable pieces run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))  # the benchmark scripts import each other as top-level modules

import headline  # noqa: E402
from precision_testutil import outlier_data  # noqa: E402

def test_every_record_is_complete_and_typed():
    runs = headline.load_runs()
    assert runs
    for file, records in runs:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}_\d{2}_[a-z0-9-]+\.json", file), file
        assert isinstance(records, list) and records, file
        for i, r in enumerate(records):
            where = f"{file} record {i} ({r.get('name')!r})"
            assert not headline.record_problems(r), f"{where}: {headline.record_problems(r)}"
            assert r["date"] <= file[:10], f"{where}: dated after its run file"


def test_an_incomplete_record_is_refused_before_anything_is_written(tmp_path):
    good = {"name": "x", "shape": "s", "backend": "b", "value": 1.0, "unit": "x", "ratio_vs_bf16": None, "command": "c",
            "date": "2026-12-06", "device": "d"}
    assert headline.write_run([good], "ok", "2026-12-06", tmp_path).exists()
    for bad in ({k: v for k, v in good.items() if k != "ratio_vs_bf16"}, {**good, "value": "1"}, {**good, "date": "6.12.2026"}):
        with pytest.raises(ValueError, match=r"write_run\('bad'\): record 1"):
            headline.write_run([good, bad], "bad", "2026-12-06", tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 1


def _gpu_report():
    import importlib.util
    import sys

    if "gpu_report" in sys.modules:
        return sys.modules["gpu_report"]
    path = BENCH / "gpu_report.py"
    spec = importlib.util.spec_from_file_location("gpu_report", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_report"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _rec(name, shape, backend, value, ratio=None, **extra):
    return dict(name=name, shape=shape, backend=backend, value=value, unit="x", ratio_vs_bf16=ratio, **extra)


def test_targets_table_reads_each_target_and_says_whether_it_is_met():
    """The one-table summary gpu_bench prints at the end: the goals against a run's records."""
    rows = {line.split(" | ")[0].lstrip("| "): line for line in _gpu_report().targets_table([
        _rec("quant_1x128", "16384x14336", "triton", 3.7, frac_of_copy=0.887),
        _rec("quant_1x128", "16384x14336", "triton", 2.6),  # a later run that measured no copy does not hide it
        _rec("quant_128x1_transposed", "16384x14336", "triton", 2.1, frac_of_copy=0.50),
        _rec("quant_128x1_transposed", "16384x14336", "triton", 2.9, frac_of_copy=0.68),  # a later record wins
        _rec("gemm_geomean_ratio_M_ge_4096", "12 shapes", "torch", 1.562, 1.562),
        _rec("gemm_geomean_ratio_M_ge_4096", "12 shapes", "deep_gemm", 1.762, 1.762),
        _rec("linear_fwd_bwd_geomean_ratio", "M=8192 4 layers deep_gemm_cached", "deep_gemm", 1.23, 1.23),
        _rec("linear_fwd_bwd_geomean_ratio", "M=8192 4 layers torch_cached", "torch", 1.5, 1.5),
        _rec("linear_fwd_bwd_geomean_ratio", "M=8192 4 layers graph", "deep_gemm", 1.458, 1.458),
        _rec("stack_train_tokens_per_s", "4 layers, batch 16 x seq 4096", "jet_fp8 deep_gemm", 113367.0, 1.267),
        _rec("linear_fwd_bwd_eager_ratio", "M=8192 4 Llama-3.1-8B projections, weights cached", "torch", 1.47, 1.47,
             min_layer_ratio=1.1, host_ratio_vs_bf16=1.25),
        _rec("stack_train_step_ratio", "4 layers, batch 16 x seq 4096", "torch", 1.31, 1.31, peak_ratio_vs_bf16=1.02),
        _rec("reference_forward_ratio", "4 layers, batch 8 x seq 4096, no grad", "torch", 1.9, 1.9, tokens=32768),
    ]).splitlines()[2:]}
    assert "| 89% | yes |" in rows["quantizer 1x128 (x, dY), % of copy"]
    assert "| 68% | no |" in rows["quantizer 128x1 written transposed (dY^T), % of copy"]
    assert "not measured in this run" in rows["quantizer 128x128 (weights), % of copy"]
    assert "| 1.562x | no |" in rows["GEMM TFLOP/s vs BF16, M >= 4096, geomean, torch"]
    assert "| 1.762x | yes |" in rows["GEMM TFLOP/s vs BF16, M >= 4096, geomean, deep_gemm"]
    # eager is the `auto` backend's row (the graph record names it), not the faster-looking torch one
    assert "| 1.230x | no |" in rows["FP8 linear fwd+bwd vs BF16, M=8192, 4 layers, eager (auto)"]
    assert "| 1.458x | yes |" in rows["FP8 linear fwd+bwd vs BF16, M=8192, 4 layers, CUDA graph (auto)"]
    assert "| 1.267x | - |" in rows["4-layer stack fwd+bwd+AdamW tokens/s vs BF16 (auto)"]
    assert "not measured" in rows["decode forward, M=64, CUDA graph, vs BF16 (auto)"]
    # The training-speed goals, from their summary records: floors and ceilings.
    assert "| >= 1.45x | 1.470x | yes |" in rows["FP8 linear fwd+bwd vs BF16, eager, M=8192, 4 layers, torch"]
    assert "| >= 1.20x | 1.100x | no |" in rows["slowest projection, torch"]
    assert "| <= 1.30x | 1.250x | yes |" in rows["host time per step over BF16's (geomean), torch"]
    assert "| <= 1.00x | 1.020x | no |" in rows["peak memory over BF16's, torch"]
    assert "not measured" in rows["reference forward (no grad, 16K tokens) vs BF16, torch"]  # only a 32K record


def test_goals_table_from_the_recorded_runs():
    """`gpu_report.py --goals` reads every run file; the newest figure of each goal wins, and the records cover
    every goal."""
    out = subprocess.run([sys.executable, "benchmarks/gpu_report.py", "--goals"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    assert len(lines) == 2 + len(_gpu_report().TARGETS)
    records = headline.load_records()
    # A goal may be unmeasured only while no run has written the summary record it reads.
    for t, line in zip(_gpu_report().TARGETS, lines[2:]):
        if "not measured" in line:
            assert t.record and not any(r.get("name") == t.record for r in records), line
    newest = headline.latest(records, "gemm_geomean_ratio_M_ge_4096", backend="torch")
    row = next(line for line in lines if line.startswith("| GEMM TFLOP/s vs BF16, M >= 4096, geomean, torch "))
    assert f"| {newest['value']:.3f}x |" in row


def test_headline_is_what_the_records_say_and_the_readme_quotes_it():
    data = json.loads(headline.HEADLINE.read_text())
    assert data["metrics"], "headline.json has no metrics"
    for key, entry in data["metrics"].items():
        for field in headline.FIELDS:
            assert entry.get(field) not in (None, ""), f"headline metric {key}: {field} missing"
        assert isinstance(entry["value"], (int, float)) and re.fullmatch(r"\d{4}-\d{2}-\d{2}", entry["date"]), key
    # Every metric read from the records equals the newest record's figure (recomputing changes nothing).
    assert headline.compute_headline(headline.load_records(), data) == data, "stale: run python benchmarks/headline.py"
    # Every metric with a record is quoted; one whose benchmark has not run yet has none (its pick is exercised on
    # records the benchmark writes in its own test, e.g. tests/benchmarks/test_grpo_vllm_gpu.py).
    records = headline.load_records()
    assert {m.key for m in headline.METRICS if m.pick(records)[0] is not None} <= set(data["metrics"])
    # The README's table is rendered from headline.json, figure for figure.
    block = headline.readme_block(headline.README.read_text())
    assert block is not None, "README.md has no generated headline table"
    assert block == headline.render_table(data), "README.md's table is stale: run python benchmarks/headline.py"
    for entry in data["metrics"].values():
        assert f"**{headline._fmt(entry)}**" in block


def test_write_run_numbers_runs_per_date(tmp_path):
    rec = {"shape": "s", "backend": "b", "value": 1.0, "unit": "x", "ratio_vs_bf16": None, "command": "c", "date": "2030-01-02",
           "device": "d"}
    first = headline.write_run([{"name": "a", **rec}], "gpu_bench quant", "2030-01-02", tmp_path)
    second = headline.write_run([{"name": "b", **rec}], "gpu_bench quant", "2030-01-02", tmp_path)
    assert (first.name, second.name) == ("2030-01-02_01_gpu-bench-quant.json", "2030-01-02_02_gpu-bench-quant.json")
    assert [r["name"] for r in headline.load_records(tmp_path)] == ["a", "b"]


# ---- gpu_bench's pieces that run without a GPU ---------------------------------------------------
def test_timing_records_carry_the_command_and_date():
    from gpu_sections import timing

    before = len(timing.RECORDS)
    timing.set_command("python3 benchmarks/gpu_bench.py --sections quant")
    try:
        r = timing.rec("quant_1x128", "16x256", "triton", 1.5, "TB/s", None, frac_of_copy=0.4)
    finally:
        timing.set_command("PYTHONUNBUFFERED=1 python3 benchmarks/gpu_bench.py --out $OUT/gpu_bench.json")
        del timing.RECORDS[before:]
    assert r["command"] == "python3 benchmarks/gpu_bench.py --sections quant" and r["date"] == timing.DATE
    assert r["frac_of_copy"] == 0.4 and r["ratio_vs_bf16"] is None


def test_benchmark_stack_model_converts_and_fuses_like_hf_llama():
    """The stack the `stack`/`decode` sections time, built small on CPU: jet_fp8 converts its projections,
    the fused SwiGLU MLP and norms give the unfused model's values bit for bit (on CPU the norms are the formula),
    and FP8 stays close to fp32."""
    from gpu_sections.llama_stack import MLP, RMSNorm, Stack

    from jetrl_precision import convert_to_fp8, fp8_linears, get_recipe
    from jetrl_precision.rmsnorm import FusedRMSNorm, fuse_rmsnorm
    from jetrl_precision.swiglu import SwiGLUMLP, fuse_swiglu

    def build():
        torch.manual_seed(0)
        model = Stack(n_layers=2, h=256, i=512, nh=2, nkv=1)
        for p in model.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.05)
        return model

    x = torch.randn(2, 8, 256, generator=torch.Generator().manual_seed(1))
    ref = build()(x)
    unfused = convert_to_fp8(build(), get_recipe("jet_fp8"), fuse_swiglu=False)
    fused = convert_to_fp8(build(), get_recipe("jet_fp8"), fuse_swiglu=False)
    fuse_swiglu(fused, classes=[MLP])  # what build_stack does, as convert_to_fp8 does for HF Llama MLPs and norms
    assert fuse_rmsnorm(fused, classes=[RMSNorm]) == 2 * 2
    assert len(fp8_linears(unfused)) == 2 * 7 and sum(isinstance(m, SwiGLUMLP) for m in fused.modules()) == 2
    assert sum(isinstance(m, FusedRMSNorm) for m in fused.modules()) == 4
    y_unfused, y_fused = unfused(x), fused(x)
    assert torch.equal(y_fused, y_unfused)
    assert 0 < float((y_unfused - ref).detach().norm() / ref.detach().norm()) < 0.1


def test_gpu_bench_imports_with_triton():
    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, "benchmarks/gpu_bench.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "--sections" in out.stdout, out.stderr[-2000:]


def test_decode_gemm_benchmark_parses_its_arguments():
    """benchmarks/decode_gemm_triton.py runs in one device call: a typo in its argument parsing must show here."""
    out = subprocess.run([sys.executable, "benchmarks/decode_gemm_triton.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "--budget" in out.stdout and "--out" in out.stdout, out.stderr[-2000:]


def test_gemm_equivalence_probe_parses_and_its_operands_are_exact():
    """benchmarks/gemm_equivalence_gpu.py runs in one device call: it parses, its float64 operands are the bytes
    times their scales exactly."""
    out = subprocess.run([sys.executable, "benchmarks/gemm_equivalence_gpu.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "--models" in out.stdout, out.stderr[-2000:]
    import gemm_equivalence_gpu as ge
    from jetrl_precision import quantize_fp8

    x = outlier_data((200, 300), generator=torch.Generator().manual_seed(3))  # partial blocks on both axes
    for block in ((1, 128), (128, 128)):
        q = quantize_fp8(x, block)
        exact = ge._exact(q)
        rows = torch.arange(200)[:, None] // block[0]
        cols = torch.arange(300)[None, :] // block[1]
        assert torch.equal(exact, q.data.double() * q.scale.double()[rows, cols])
        assert float((exact - x.double()).norm() / x.double().norm()) < 0.05


@pytest.mark.parametrize("script", ["attention_decode_gpu.py", "kv_decode_gpu.py"])
def test_attention_decode_probes_parse_and_need_a_device_or_the_interpreter(script):
    """The attention probes (benchmarks/attention_decode_gpu.py, kv_decode_gpu.py) run early in a lease: they parse,
    and without CUDA or TRITON_INTERPRET they say so in one line instead of failing inside Triton."""
    out = subprocess.run([sys.executable, f"benchmarks/{script}", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "--seqs" in out.stdout and "--record" in out.stdout, out.stderr[-2000:]
    if not torch.cuda.is_available():
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        out = subprocess.run([sys.executable, f"benchmarks/{script}", "--out", os.devnull], cwd=ROOT,
                             capture_output=True, text=True, env=env)
        assert out.returncode == 2 and "no CUDA device" in out.stderr, out.stderr[-2000:]


def test_device_scripts_parse_and_name_known_sections():
    """The one-call GPU scripts are bash that must not fail on a typo after minutes of building: they parse, and the
    sections they ask gpu_bench for exist."""
    for script in ("gpu_train_speed.sh", "gpu_all.sh", "deep_gemm_device.sh"):
        r = subprocess.run(["bash", "-n", str(BENCH / script)], capture_output=True, text=True)
        assert r.returncode == 0, f"{script}: {r.stderr}"
    doc = (BENCH / "gpu_bench.py").read_text()
    block = doc[doc.index("Sections ("):doc.index("Timing (")]
    known = set(re.findall(r"^  ([a-z]+) +\S", block, re.M))
    for script in ("gpu_train_speed.sh", "gpu_all.sh"):
        default = re.search(r"SECTIONS=\$\{SECTIONS:-([\w,]+)\}", (BENCH / script).read_text()).group(1)
        assert set(default.split(",")) <= known, (script, set(default.split(",")) - known)


def test_vllm_bitwise_record_takes_the_worst_token_of_every_recipe_and_layout(tmp_path):
    import vllm_bitwise_record as vbr

    def job(recipe, differing, max_abs):
        same = {"tokens": 100, "differing_tokens": 0, "max_abs_dlogp": 0.0}
        return {"recipe": recipe, "model": "/tmp/smol_hf", "mode": "default (torch.compile + CUDA graphs)", "prompts": 16,
                "date": "2026-12-02", "start_seconds": 50.0, "generate_seconds": 6.0, "padded": same,
                "packed": {"tokens": 100, "differing_tokens": differing, "max_abs_dlogp": max_abs}}

    exact = vbr.records_from([job("bf16", 0, 0.0), job("jet_fp8", 0, 0.0)], "NVIDIA H200", "cmd")
    summary = [r for r in exact if r["name"] == "bitwise_logprob_mismatch"]
    assert len(summary) == 1 and summary[0]["value"] == 0.0 and summary[0]["tokens_compared"] == 400
    assert "SmolLM2" in summary[0]["shape"] and summary[0]["backend"] == "bf16+jet_fp8"
    leaky = vbr.records_from([job("bf16", 0, 0.0), job("jet_fp8", 3, 2.5e-7)], "NVIDIA H200", "cmd")
    worst = next(r for r in leaky if r["name"] == "bitwise_logprob_mismatch")
    assert worst["value"] == 2.5e-7 and worst["differing_tokens"] == 3
    per = {(r["backend"], r["shape"].rsplit(", ", 1)[-1]): r["value"] for r in leaky if r["name"] != "bitwise_logprob_mismatch"}
    assert per == {("bf16", "padded recompute"): 0, ("bf16", "packed recompute"): 0,
                   ("jet_fp8", "padded recompute"): 0, ("jet_fp8", "packed recompute"): 3}
    with pytest.raises(SystemExit, match="no bitwise_"):
        vbr.records_from([], "NVIDIA H200", "cmd")


def test_vllm_kv8_throughput_rows_become_the_gain_and_the_headline_ratio(tmp_path):
    import vllm_gpu

    def job(recipe, tps):
        return {"job": "throughput", "start_only": False, "recipe": recipe, "mode": "default", "layers": 32, "start_seconds": 60.0,
                "gemm_backends": ["torch"] if recipe != "bf16" else [], "quant_kernels": [], "date": "2026-12-07",
                "runs": [{"prompts": p, "output_tokens": p * 1024, "seconds": 1.0, "tokens_per_s": t, "mean_sampled_logprob": -11.0}
                         for p, t in zip((256, 64), tps)]}

    for recipe, tps in (("bf16", (10000.0, 8000.0)), ("jet_fp8", (11000.0, 9600.0)), ("jet_fp8+kv8", (13200.0, 10400.0)),
                        ("bf16+tattn", (9000.0, 7600.0)), ("jet_fp8+tattn", (9900.0, 9120.0))):
        (tmp_path / f"throughput_{recipe}_default.json").write_text(json.dumps(job(recipe, tps)))
    recs = [dict(r, _run_file="x") for r in vllm_gpu.records_from(tmp_path, "NVIDIA H200", "cmd")]
    gain = {r["shape"].split(", ")[2].split(" x ")[0]: r for r in recs if r["name"] == "kv_cache_e4m3_rollout_gain"}
    assert gain["256 prompts"]["value"] == 1.2 and gain["64 prompts"]["value"] == pytest.approx(1.0833, abs=1e-4)
    picks = {m.key: m.pick(recs)[0] for m in headline.METRICS if m.key.startswith("vllm_rollout_tokens_per_s_ratio")}
    assert picks["vllm_rollout_tokens_per_s_ratio_kv8"] == pytest.approx(1.32)
    assert picks["vllm_rollout_tokens_per_s_ratio_kv8_64"] == pytest.approx(1.3)
    assert picks["vllm_rollout_tokens_per_s_ratio"] == pytest.approx(1.1)  # plain jet_fp8 keeps its own row
    # +tattn: the same recipe on the e4m3 cache's attention backend, its cost against the recipe on its default one;
    # it files under no headline row (the kv8 and plain rows above read the same with it present)
    cost = {(r["backend"].partition("/")[0], r["shape"].split(", ")[2].split(" x ")[0]): r["value"]
            for r in recs if r["name"] == "triton_attention_rollout_cost"}
    assert cost == {("bf16+tattn", "256 prompts"): 0.9, ("bf16+tattn", "64 prompts"): 0.95,
                    ("jet_fp8+tattn", "256 prompts"): 0.9, ("jet_fp8+tattn", "64 prompts"): 0.95}


def test_kv_cache_jobs_become_the_mismatch_over_plain_jet_fp8(tmp_path):
    import vllm_gpu

    common = {"job": "kv_cache", "model": "/tmp/smol_hf", "violations": [], "tokens": 4000, "max_abs_dlogp": 0.5,
              "device": "NVIDIA H200", "date": "2026-12-08"}
    (tmp_path / "kv_cache_jet_fp8_kv8.json").write_text(json.dumps(dict(
        common, recipe="jet_fp8+kv8", kv_cache="e4m3/scale=1/nearest-even", mean_abs_dlogp=0.126, mean_abs_dlogp_unmirrored=0.2)))
    (tmp_path / "kv_cache_jet_fp8.json").write_text(json.dumps(dict(common, recipe="jet_fp8", kv_cache="auto", mean_abs_dlogp=0.12)))
    recs = [dict(r, _run_file="x") for r in vllm_gpu.records_from(tmp_path, None, "cmd")]
    (rec,) = [r for r in recs if r["name"] == "kv_cache_e4m3_logprob_mismatch"]
    assert rec["value"] == 0.126 and rec["plain_jet_fp8"] == 0.12 and rec["x_plain"] == 1.05 and rec["unmirrored"] == 0.2
    assert rec["device"] == "NVIDIA H200" and rec["shape"].startswith("smol_hf, 4000 sampled tokens")
    value, _ = next(m for m in headline.METRICS if m.key == "kv_cache_e4m3_logprob_mismatch_x_plain").pick(recs)
    assert value == 1.05


def test_vllm_bitwise_throughput_rows_become_the_cost_ratio(tmp_path):
    import argparse

    import vllm_gpu

    def job(recipe, tps):
        return {"job": "throughput", "start_only": False, "recipe": recipe, "mode": "default", "layers": 8, "start_seconds": 60.0,
                "gemm_backends": ["triton_invariant" if "bitwise" in recipe else "torch"] if recipe != "bf16" else [],
                "quant_kernels": [], "date": "2026-12-02",
                "runs": [{"prompts": p, "output_tokens": p * 1024, "seconds": 1.0, "tokens_per_s": t, "mean_sampled_logprob": -11.0}
                         for p, t in zip((256, 64), tps)]}

    for recipe, tps in (("bf16", (30000.0, 10000.0)), ("jet_fp8", (33000.0, 12000.0)), ("jet_fp8+bitwise", (29700.0, 9600.0))):
        (tmp_path / f"throughput_{recipe}_default.json").write_text(json.dumps(job(recipe, tps)))
    recs = vllm_gpu.records_from(tmp_path, "NVIDIA H200", "cmd")
    cost = {r["shape"].split(", ")[2].split(" x ")[0]: r for r in recs if r["name"] == "bitwise_rollout_cost_ratio"}
    assert cost["256 prompts"]["value"] == 0.9 and cost["64 prompts"]["value"] == 0.8
    assert cost["256 prompts"]["ratio_vs_bf16"] == pytest.approx(0.99)
    value, _ = next(m for m in headline.METRICS if m.key == "bitwise_rollout_cost_ratio_invariant_kernels").pick(
        [dict(r, _run_file="x") for r in recs])
    assert value == 0.9  # no vendor_route in the jobs: the strict mode's row, 8 layers
    text = vllm_gpu.summarize([job(r, t) for r, t in (("bf16", (30000.0, 1.0)), ("jet_fp8", (33000.0, 1.0)), ("jet_fp8+bitwise", (29700.0, 1.0)))])
    assert "jet_fp8+bitwise" in text and "x jet_fp8 0.900" in text
    recipe, bitwise = vllm_gpu._recipe(argparse.Namespace(recipe="jet_fp8+bitwise", gemm_backend="torch"))
    assert bitwise and recipe.name == "jet_fp8" and recipe.gemm_backend != "torch"
    with pytest.raises(SystemExit, match="the suffixes are"):
        vllm_gpu._recipe(argparse.Namespace(recipe="jet_fp8+fast", gemm_backend=None))
    recipe, bitwise = vllm_gpu._recipe(argparse.Namespace(recipe="jet_fp8+kv8", gemm_backend="torch"))
    assert not bitwise and recipe.kv_cache == "e4m3" and recipe.gemm_backend == "torch"
    recipe, bitwise = vllm_gpu._recipe(argparse.Namespace(recipe="jet_fp8@triton", gemm_backend="torch"))
    assert not bitwise and recipe.name == "jet_fp8" and recipe.gemm_backend == "triton"
    with pytest.raises(SystemExit, match="own GEMM"):
        vllm_gpu._recipe(argparse.Namespace(recipe="jet_fp8@triton+bitwise", gemm_backend=None))
    # a recipe with a pinned backend sits beside the plain one and is not mistaken for it
    text = vllm_gpu.summarize([job(r, t) for r, t in (("bf16", (30000.0, 1.0)), ("jet_fp8", (33000.0, 1.0)), ("jet_fp8@triton", (31500.0, 1.0)))])
    assert "jet_fp8@triton" in text and "x bf16 1.050" in text


def test_engines_run_alone_say_so_and_file_under_the_same_headline_row(tmp_path):
    """32 layers at 256 prompts on an 80 GB card: each engine runs alone (h200_vllm.sh eager32_alone). The rate files
    under the headline's shape, with how it was run beside it; the start time does not claim company it had."""
    import vllm_gpu

    def job(recipe, tps, together):
        return {"job": "throughput", "start_only": False, "recipe": recipe, "mode": "eager", "layers": 32, "start_seconds": 28.0,
                "gemm_backends": [] if recipe == "bf16" else ["torch"], "quant_kernels": [], "date": "2026-12-07",
                "engines_together": together,
                "runs": [{"prompts": 256, "output_tokens": 256 * 1024, "seconds": 1.0, "tokens_per_s": tps, "mean_sampled_logprob": -11.0}]}

    for together in (1, 2):
        d = tmp_path / str(together)
        d.mkdir()
        for recipe, tps in (("bf16", 8000.0), ("jet_fp8", 8400.0)):
            (d / f"throughput_{recipe}_eager.json").write_text(json.dumps(job(recipe, tps, together)))
        recs = vllm_gpu.records_from(d, "NVIDIA H100 80GB HBM3", "cmd")
        rates = [r for r in recs if r["name"] == "vllm_rollout_tokens_per_s"]
        assert {r["shape"] for r in rates} == {"Llama-3.1-8B shape, 32 layers, 256 prompts x 256 + 1024 new tokens, eager"}
        assert {r.get("engines") for r in rates} == ({"each alone in its own process, one after the other"} if together == 1 else {None})
        starts = {r["shape"] for r in recs if r["name"] == "vllm_first_start_seconds"}
        assert starts == {f"Llama-3.1-8B shape, 32 layers, eager, cold cache, {'starting alone' if together == 1 else '2 engines starting together'}"}
        value, _ = next(m for m in headline.METRICS if m.key == "vllm_rollout_tokens_per_s_ratio_eager").pick(
            [dict(r, _run_file="x") for r in recs])
        assert value == pytest.approx(1.05)
        text = vllm_gpu.summarize([job(r, t, together) for r, t in (("bf16", 8000.0), ("jet_fp8", 8400.0))])
        assert ("each engine alone" in text) == (together == 1)
    # Rounds (one folder each) pool their passes: the median of each recipe's, the ratio of the medians
    rounds = []
    for i, (b, f) in enumerate(((10969.2, 10474.6), (9907.0, 10020.1), (10267.3, 10964.0))):
        d = tmp_path / f"r{i}"
        d.mkdir()
        for recipe, tps in (("bf16", b), ("jet_fp8", f)):
            (d / f"throughput_{recipe}_eager.json").write_text(json.dumps({**job(recipe, tps, 1), "start_seconds": 50.0 - i}))
        rounds.append(d)
    recs = vllm_gpu.records_from(rounds, "NVIDIA H100 80GB HBM3", "cmd")
    (fp8,) = [r for r in recs if r["name"] == "vllm_rollout_tokens_per_s" and r["backend"] != "bf16"]
    assert fp8["value"] == 10474.6 and fp8["ratio_vs_bf16"] == pytest.approx(10474.6 / 10267.3)
    assert fp8["rounds"] == 3 and fp8["tokens_per_s_each"] == [10474.6, 10020.1, 10964.0]
    assert {r["value"] for r in recs if r["name"] == "vllm_first_start_seconds"} == {50.0}  # the first round's (cold) start
    assert len(recs) == 4
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "throughput_bf16_eager.json").write_text(json.dumps({**job("bf16", 1.0, 1), "runs": [{**job("bf16", 1.0, 1)["runs"][0], "prompts": 64}]}))
    with pytest.raises(SystemExit, match="does not match the first round"):
        vllm_gpu.records_from([rounds[0], bad], "NVIDIA H100 80GB HBM3", "cmd")


def test_decode_gemm_runs_are_labelled_and_give_the_gain_over_cublaslt(tmp_path):
    """decode32's A/B (the engine's auto against jet_fp8@torch) becomes vllm_decode_gemm_gain; the rollout headline
    reads the engine's auto whichever decode GEMM it ran, and never a pinned recipe."""
    import vllm_gpu

    def job(recipe, tps, decode=""):
        return {"job": "throughput", "start_only": False, "recipe": recipe, "mode": "default", "layers": 32, "start_seconds": 60.0,
                "gemm_backends": ["torch"] if recipe != "bf16" else [], "decode_gemm": decode, "quant_kernels": [],
                "date": "2026-12-03",
                "runs": [{"prompts": p, "output_tokens": p * 1024, "seconds": 1.0, "tokens_per_s": t, "mean_sampled_logprob": -11.0}
                         for p, t in zip((256, 64), tps)]}

    (tmp_path / "a.json").write_text(json.dumps(job("jet_fp8", (16800.0, 10260.0), "deep_gemm (M <= 512)")))
    (tmp_path / "b.json").write_text(json.dumps(job("jet_fp8@torch", (16000.0, 9000.0))))
    recs = vllm_gpu.records_from(tmp_path, "NVIDIA H200", "cmd")
    gain = {r["shape"].split(", ")[2].split(" x ")[0]: r for r in recs if r["name"] == "vllm_decode_gemm_gain"}
    assert gain["256 prompts"]["value"] == 1.05 and gain["64 prompts"]["value"] == 1.14
    assert gain["64 prompts"]["backend"] == "jet_fp8/torch+deep_gemm(M<=512)"
    value, _ = next(m for m in headline.METRICS if m.key == "vllm_decode_gemm_gain_64").pick([dict(r, _run_file="x") for r in recs])
    assert value == 1.14
    (tmp_path / "c.json").write_text(json.dumps(job("bf16", (15000.0, 9000.0))))
    recs = vllm_gpu.records_from(tmp_path, "NVIDIA H200", "cmd")
    ratio = next(m for m in headline.METRICS if m.key == "vllm_rollout_tokens_per_s_ratio_64")
    value, rec = ratio.pick([dict(r, _run_file="x") for r in recs])
    assert value == pytest.approx(10260.0 / 9000.0) and "@" not in rec["backend"]


def test_grpo_bitwise_recipe_flags_and_its_step_ratio():
    import grpo_vllm_gpu as g

    argv = g.recipe_argv("jet_fp8+bitwise")
    assert "--precision.bitwise" in argv and "--fp8_unified" in argv
    if torch.cuda.is_available():
        assert argv[argv.index("--precision.gemm_backend") + 1] == "triton_invariant" and "--rollout.engine" not in argv
    else:  # vLLM's bitwise mode is CUDA only: the transformers engine, the float64-emulated FP8 GEMM
        assert argv[argv.index("--rollout.engine") + 1] == "hf" and argv[argv.index("--precision.gemm_backend") + 1] == "emulated"

    def run(recipe, old_s, step_s):
        steps = [{"perf/step_s": step_s, "perf/generate_s": 1.0, "perf/old_logprob_s": old_s, "perf/train_s": 2.0,
                  "perf/rollout_tokens_per_s": 1000.0, "rollout_train_mismatch/abs_logp_diff_mean": 0.0,
                  "bitwise/engine_logprobs_used": 1.0, "bitwise/fallbacks": 0.0} for _ in range(3)]
        return {"part": "speed", "recipe": recipe, "rc": 0, "timed_out": False, "steps": steps, "shape": "s", "params": 1,
                "wall_s": 1.0, "plan": {"layers": 8, "gemm_backend": "torch"}}

    recs = g.records_from([run("bf16", 1.0, 6.0), run("jet_fp8", 0.8, 5.0), run("jet_fp8+bitwise", 0.1, 4.0)], {}, "cmd")
    r = next(r for r in recs if r["name"] == "bitwise_e2e_step_ratio")
    assert r["value"] == 1.25 and r["ratio_vs_bf16"] == 1.5 and r["old_logprob_s"] == {"jet_fp8": 0.8, "jet_fp8+bitwise": 0.1}
    assert r["engine_logprobs_used"] == [1.0, 1.0] and r["fallbacks"] == 0.0


def test_runs_with_the_cublaslt_route_are_labelled_and_each_mode_has_its_own_headline_rows(tmp_path):
    """The cuBLASLt route (the bitwise default) runs other kernels than JETRL_INVARIANT_VENDOR_GEMM=off: every record
    writer says so in the backend, the default rows read only routed records and the `_invariant_kernels` rows only
    the others."""
    import grpo_vllm_gpu as g
    import vllm_bitwise_record as vbr
    import vllm_gpu

    assert headline.route_suffix(None) == headline.route_suffix({}) == headline.route_suffix({"a": False}) == ""
    assert headline.route_suffix({"a": True, "b": False, "c": True}) == "+cublaslt_route(2/3 shapes)"
    metric = {m.key: m for m in headline.METRICS}

    def pick(key, recs):
        return metric[key].pick([dict(r, _run_file="x") for r in recs])[0]

    # the proof
    exact = {"tokens": 100, "differing_tokens": 0, "max_abs_dlogp": 0.0}
    jobs = [{"recipe": r, "model": "/m/llama8b_l8", "mode": "default", "prompts": 144, "date": "2026-12-04", "padded": exact,
             "packed": exact, "vendor_route": {"6144 x 4096": True, "4096 x 14336": False}} for r in ("bf16", "jet_fp8")]
    proof = vbr.records_from(jobs, "NVIDIA H200", "cmd")
    summary = next(r for r in proof if r["name"] == "bitwise_logprob_mismatch")
    assert summary["backend"] == "bf16+jet_fp8+cublaslt_route(1/2 shapes)"
    assert {r["backend"] for r in proof if r["name"] != "bitwise_logprob_mismatch"} == {
        "bf16+cublaslt_route(1/2 shapes)", "jet_fp8+cublaslt_route(1/2 shapes)"}
    assert pick("bitwise_logprob_mismatch_8b", proof) == 0.0 and pick("bitwise_logprob_mismatch_8b_invariant_kernels", proof) is None
    plain = vbr.records_from([{k: v for k, v in j.items() if k != "vendor_route"} for j in jobs], "NVIDIA H200", "cmd")
    assert pick("bitwise_logprob_mismatch_8b", plain) is None and pick("bitwise_logprob_mismatch_8b_invariant_kernels", plain) == 0.0

    # the rollout cost
    def job(recipe, tps, route=None):
        return {"job": "throughput", "start_only": False, "recipe": recipe, "mode": "default", "layers": 32, "start_seconds": 60.0,
                "gemm_backends": ["triton_invariant" if "bitwise" in recipe else "torch"], "quant_kernels": [], "date": "2026-12-04",
                "runs": [{"prompts": 256, "output_tokens": 256 * 1024, "seconds": 1.0, "tokens_per_s": tps, "mean_sampled_logprob": -11.0}],
                **({"vendor_route": route} if route is not None else {})}

    (tmp_path / "throughput_jet_fp8_default.json").write_text(json.dumps(job("jet_fp8", 20000.0, route={})))
    (tmp_path / "throughput_jet_fp8+bitwise_default.json").write_text(
        json.dumps(job("jet_fp8+bitwise", 18400.0, route={"6144 x 4096": True, "4096 x 14336": False})))
    recs = vllm_gpu.records_from(tmp_path, "NVIDIA H200", "cmd")
    cost = next(r for r in recs if r["name"] == "bitwise_rollout_cost_ratio")
    assert cost["backend"] == "jet_fp8+bitwise+cublaslt_route(1/2 shapes)" and cost["value"] == 0.92
    assert next(r for r in recs if r["name"] == "vllm_rollout_tokens_per_s" and "bitwise" in r["backend"])["backend"] == (
        "jet_fp8+bitwise/triton_invariant+cublaslt_route(1/2 shapes)")
    assert pick("bitwise_rollout_cost_ratio", recs) == 0.92 and pick("bitwise_rollout_cost_ratio_invariant_kernels", recs) is None

    # the GRPO step: only the bitwise recipe runs triton_invariant, so only it is labelled
    def run(recipe, step_s, route):
        steps = [{"perf/step_s": step_s, "perf/generate_s": 1.0, "perf/old_logprob_s": 0.5, "perf/train_s": 2.0,
                  "perf/rollout_tokens_per_s": 1000.0, "rollout_train_mismatch/abs_logp_diff_mean": 0.0} for _ in range(3)]
        return {"part": "speed", "recipe": recipe, "rc": 0, "timed_out": False, "steps": steps, "shape": "s", "params": 1,
                "wall_s": 1.0, "plan": {"layers": 8, "gemm_backend": "torch"}, "vendor_route": route}

    recs = g.records_from([run("jet_fp8", 5.0, "probe"), run("jet_fp8+bitwise", 4.0, "probe")], {}, "cmd")
    assert {r["backend"] for r in recs if r["name"] == "e2e_grpo_step_s"} == {"jet_fp8", "jet_fp8+bitwise+cublaslt_route(probe)"}
    assert pick("bitwise_e2e_step_ratio", recs) == 1.25 and pick("bitwise_e2e_step_ratio_invariant_kernels", recs) is None
    for off in ("off", ""):  # "": runs from before the route was the default
        recs = g.records_from([run("jet_fp8", 5.0, off), run("jet_fp8+bitwise", 4.0, off)], {}, "cmd")
        assert pick("bitwise_e2e_step_ratio", recs) is None and pick("bitwise_e2e_step_ratio_invariant_kernels", recs) == 1.25

    # keys of the earlier layout leave headline.json when it is rewritten
    stale = {"metrics": {"bitwise_rollout_cost_ratio_cublaslt_route": {"value": 0.9}, "own_figure": {"value": 1.0}}}
    assert set(headline.compute_headline([], stale)["metrics"]) == {"own_figure"}


def test_decode_profile_groups_kernels_and_subtracts_the_prefill():
    import vllm_decode_profile as vdp

    names = {
        "sm90_xmma_gemm_bf16bf16_bf16f32": "gemm", "nvjet_tst_128x64_64x4": "gemm", "_fp8_kernel": "gemm",
        "_sum_splits_kernel": "gemm", "_quantize_1x128_kernel": "quantize", "_attention_kernel": "attention",
        "kernel_unified_attention_2d": "attention", "reshape_and_cache_flash_kernel": "attention",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "norm", "_rms_norm_kernel": "norm",
        "_rotary_kernel": "rotary", "rotary_embedding_kernel": "rotary", "act_and_mul_kernel": "silu*mul",
        "_log_softmax_kernel": "sampler/log-probs", "void at::native::elementwise_kernel<128, 4>": "other",
    }
    assert {n: vdp.category(n) for n in names} == names
    per = vdp.decode_kernels({"a": 100.0, "b": 50.0, "c": 10.0}, {"a": 420.0, "b": 49.0, "d": 64.0}, steps=32)
    assert per == {"a": 10.0, "b": 0.0, "c": 0.0, "d": 2.0}
    res = [{"recipe": r, "mode": "default", "layers": 8, "prompts": 256, "prompt_len": 256, "steps": 32, "kernels_captured": k,
            "decode_step_wall_us": w, "decode_step_kernel_us": w - 50, "categories_us": {"gemm": w - 100, "attention": 50.0},
            "top_kernels_us": [["x", 1.0, "gemm"]]} for r, w, k in (("bf16", 900.0, 40), ("jet_fp8", 1000.0, 0))]
    text = vdp.summarize(res)
    assert "| gemm | 800.0 | 900.0 |" in text and "| wall | 900 | 1000 |" in text
    assert "jet_fp8: the profiler recorded no GPU kernels" in text


def test_decode_profile_kills_a_child_that_hangs_after_writing_its_profile(tmp_path, capsys):
    """A child whose profile is on disk but which never exits is killed after the grace period and counts as done;
    one that writes nothing is killed at its deadline and counts as failed."""
    import time

    import vllm_decode_profile as vdp

    hang = "import pathlib, sys, time; pathlib.Path(sys.argv[1]).write_text('{}'); time.sleep(600)"
    silent = "import time; time.sleep(600)"
    for code, name in ((hang, "hangs"), (silent, "silent")):
        f = tmp_path / f"{name}.json"
        proc = subprocess.Popen([sys.executable, "-c", code, str(f)])
        t0 = time.time()
        vdp._finish(name, proc, f, timeout=8.0, grace_s=1.0)
        assert proc.poll() is not None and time.time() - t0 < 30
    out = capsys.readouterr().out
    assert "hangs: wrote its profile but did not exit within 1 s; killed" in out and "hangs: done" in out
    assert "silent: FAILED (timeout)" in out


def test_decode_profile_records_carry_each_group_and_the_ratio_to_bf16(tmp_path):
    import vllm_decode_profile as vdp

    res = [{"recipe": r, "mode": "default", "layers": 8, "prompts": 256, "prompt_len": 256, "steps": 32, "kernels_captured": 40,
            "decode_step_wall_us": w, "decode_step_kernel_us": w / 2, "categories_us": {"gemm": w / 4, "attention": 50.0},
            "top_kernels_us": [["x", 1.0, "gemm"]], "date": "2026-12-02"} for r, w in (("bf16", 900.0), ("jet_fp8", 1200.0))]
    res.append(dict(res[1], recipe="jet_fp8", mode="eager", decode_step_wall_unprofiled_us=1100.0, host_self_us=[["a.py:f:1", 5.0]],
                    host_cum_us=[["a.py:f", 7.0]], eager_linear_call="native (64 of 64 projections)"))
    recs = json.loads(vdp.record(res, "NVIDIA H200", "cmd", runs_dir=tmp_path).read_text())
    eager = [r for r in recs if r["shape"].split(", ")[5] == "eager"]
    bare = next(r for r in eager if r["name"] == "decode_step_wall_unprofiled_us")
    assert bare["value"] == 1100.0 and bare["eager_linear_call"].startswith("native") and bare["host_cum_us"] == [["a.py:f", 7.0]]
    assert bare["ratio_vs_bf16"] is None  # bf16 timed no unprofiled wall here
    recs = [r for r in recs if r not in eager]
    by = {(r["name"], r["shape"].rsplit(", ", 1)[-1], r["backend"]): r for r in recs}
    assert by[("decode_step_wall_us", "default", "jet_fp8")]["ratio_vs_bf16"] == 0.75
    assert by[("decode_step_group_us", "gemm", "jet_fp8")]["value"] == 300.0
    assert by[("decode_step_group_us", "attention", "bf16")]["ratio_vs_bf16"] == 1.0
    assert by[("decode_step_kernel_us", "default", "bf16")]["top_kernels_us"] == [["x", 1.0, "gemm"]]
    assert all(r["unit"] == "us" and r["device"] == "NVIDIA H200" for r in recs) and len(recs) == 8


def test_a_newer_record_without_the_ratio_does_not_hide_an_older_one_with_it():
    import headline

    shape = headline.VLLM_8B.format(32, 256, "default")
    older = {"name": "vllm_rollout_tokens_per_s", "shape": shape, "backend": "jet_fp8/torch", "value": 24000.0, "ratio_vs_bf16": 0.75,
             "_run_file": "a"}
    newer = dict(older, value=34000.0, ratio_vs_bf16=None, _run_file="b")  # a run that timed no bf16
    metric = next(m for m in headline.METRICS if m.key == "vllm_rollout_tokens_per_s_ratio")
    assert metric.pick([older, newer])[0] == 0.75
    assert metric.pick([older, dict(newer, ratio_vs_bf16=0.85)])[0] == 0.85


def test_the_rollout_headline_is_the_full_depth_model_and_the_8_layer_figure_has_its_own_key():
    import headline

    def rec(layers, prompts, mode, ratio, backend="jet_fp8/torch"):
        return {"name": "vllm_rollout_tokens_per_s", "shape": headline.VLLM_8B.format(layers, prompts, mode), "backend": backend,
                "value": 1.0, "ratio_vs_bf16": ratio, "_run_file": f"{layers}-{prompts}-{mode}-{backend}"}

    recs = [rec(8, 256, "default", 0.75), rec(32, 256, "default", 1.15), rec(32, 64, "default", 1.09), rec(32, 256, "eager", 0.92),
            rec(32, 64, "eager", 1.02), rec(32, 64, "eager", 0.63, "jet_fp8/torch+deep_gemm(M<=512)"),  # not what eager runs
            rec(8, 256, "eager", 1.07), rec(32, 256, "default", 0.94, "jet_fp8+bitwise/triton_invariant"),
            rec(32, 256, "default", 1.21, "jet_fp8+bitwise/triton_invariant+cublaslt_route(4/5 shapes)"),
            rec(16, 256, "eager", 0.93), rec(16, 64, "eager", 1.25),
            # an A/B arm with an engine switch set names it in its shape: never the shipped engine's figure
            dict(rec(16, 256, "eager", 0.77), shape=headline.VLLM_8B.format(16, 256, "eager") + ", JETRL_NATIVE_LINEAR=0",
                 _run_file="zz-newest-arm")]
    picked = {m.key: m.pick(recs)[0] for m in headline.METRICS if m.key.startswith(("vllm_rollout_tokens", "bitwise_rollout_tokens"))}
    assert picked == {"vllm_rollout_tokens_per_s_ratio": 1.15, "vllm_rollout_tokens_per_s_ratio_64": 1.09,
                      "vllm_rollout_tokens_per_s_ratio_eager": 0.92, "vllm_rollout_tokens_per_s_ratio_eager_64": 1.02,
                      "vllm_rollout_tokens_per_s_ratio_8layers": 0.75,
                      "vllm_rollout_tokens_per_s_ratio_8layers_64": None, "vllm_rollout_tokens_per_s_ratio_8layers_eager": 1.07,
                      "vllm_rollout_tokens_per_s_ratio_16layers_eager": 0.93, "vllm_rollout_tokens_per_s_ratio_16layers_eager_64": 1.25,
                      "bitwise_rollout_tokens_per_s_ratio": 1.21, "bitwise_rollout_tokens_per_s_ratio_invariant_kernels": 0.94,
                      "bitwise_rollout_tokens_per_s_ratio_64": None, "bitwise_rollout_tokens_per_s_ratio_64_invariant_kernels": None,
                      "vllm_rollout_tokens_per_s_ratio_kv8": None, "vllm_rollout_tokens_per_s_ratio_kv8_64": None}


def test_rows_labelled_deep_gemm_skip_runs_whose_auto_resolved_to_torch():
    """On a device without DeepGEMM `auto` resolves to torch: that newer run fills the torch rows, never the rows
    whose label names the deep_gemm backend."""
    def run(file, backend, peaks, ratio, graph, cached):
        """One gpu_bench run's stack and linear records, its `auto` having resolved to `backend`."""
        linear = "linear_fwd_bwd_geomean_ratio"
        return [{"name": "stack_train_tokens_per_s", "backend": "bf16", "peak_mem_gib": peaks[0], "ratio_vs_bf16": 1.0,
                 "_run_file": file},
                {"name": "stack_train_tokens_per_s", "backend": f"jet_fp8 {backend}", "peak_mem_gib": peaks[1],
                 "ratio_vs_bf16": ratio, "_run_file": file},
                {"name": linear, "shape": "M=8192 4 layers graph", "backend": backend, "value": graph, "_run_file": file},
                {"name": linear, "shape": f"M=8192 4 layers {backend}_cached", "backend": backend, "value": cached,
                 "_run_file": file}]

    dg_run = run("a", "deep_gemm", (60.0, 54.0), 1.29, 1.45, 1.31)
    torch_run = run("b", "torch", (62.0, 55.0), 1.26, 1.36, 1.34)
    picked = {m.key: m.pick(dg_run + torch_run)[0] for m in headline.METRICS}
    assert picked["stack_train_tokens_per_s_ratio"] == 1.29 and picked["stack_peak_memory_ratio"] == 0.9
    assert picked["linear_fwd_bwd_vs_bf16_cuda_graph"] == 1.45 and picked["linear_fwd_bwd_vs_bf16_eager"] == 1.31
    assert picked["linear_fwd_bwd_vs_bf16_eager_cublaslt"] == 1.34
    only_torch = {m.key: m.pick(torch_run)[0] for m in headline.METRICS}
    assert only_torch["stack_train_tokens_per_s_ratio"] is None and only_torch["linear_fwd_bwd_vs_bf16_cuda_graph"] is None


def test_the_grpo_step_ratio_reads_the_deepest_model_measured():
    """An 8-layer run on a smaller card, newer than the 16-layer one, does not replace the 16-layer figure; a newer
    16-layer run does. fp8_rollout's ratio is read the same way, on its own row."""
    def step(layers, backend, ratio, gpus=1, liger=False):
        shape = f"Llama-3.1-8B shape, {layers} layers (x.xxB), 64 prompts{', Liger' if liger else ''}"
        return {"name": "e2e_grpo_step_s", "shape": shape, "backend": backend, "ratio_vs_bf16": ratio, "gpus": gpus}

    older16, newer8 = step(16, "jet_fp8", 1.17), step(8, "jet_fp8", 1.2)
    others = [step(16, "jet_fp8", 1.5, gpus=2), step(32, "jet_fp8", 1.6, liger=True), step(8, "fp8_rollout", 1.03)]
    metric = {m.key: m for m in headline.METRICS}
    ratio, fp8_rollout = metric["e2e_grpo_step_ratio_1gpu"], metric["e2e_grpo_step_ratio_1gpu_fp8_rollout"]
    assert ratio.pick([older16, newer8, *others])[0] == 1.17
    assert ratio.pick([older16, newer8, step(16, "jet_fp8", 1.22), *others])[0] == 1.22
    assert ratio.pick([newer8, *others])[0] == 1.2
    assert fp8_rollout.pick([older16, newer8, *others])[0] == 1.03


def test_layers_section_runs_its_variants_on_a_small_cpu_stack(monkeypatch):
    """gpu_bench's `layers` section (stacked against separate projections) end to end on a small CPU stack, its
    timers stubbed: every variant runs, the stacked and separate outputs are compared, and the records are typed."""
    import types

    from gpu_sections import layers, timing
    from gpu_sections.llama_stack import MLP, Stack

    from jetrl_precision import convert_to_fp8, get_recipe
    from jetrl_precision.swiglu import fuse_swiglu

    def build(variant, seed=0):
        torch.manual_seed(seed)
        model = Stack(n_layers=2, h=256, i=512, nh=2, nkv=1).to(torch.bfloat16)
        if variant != "bf16":
            convert_to_fp8(model, get_recipe("jet_fp8"), fuse_swiglu=False, fuse_projections=not variant.endswith(":separate"))
            fuse_swiglu(model, classes=[MLP])
        return model

    def timed(fn, **_):
        fn()
        return 1.0

    monkeypatch.setattr(layers, "build_stack", build)
    monkeypatch.setattr(layers, "bench", timed)
    monkeypatch.setattr(layers, "busy_us", lambda fn, n=1: timed(fn) * 100)
    monkeypatch.setattr(layers, "resolve_backend", lambda b, dev: "emulated")
    monkeypatch.setattr(layers, "data", lambda m, k, seed=0: outlier_data((m, k)).to(torch.bfloat16))
    monkeypatch.setattr(timing, "RECORDS", [])
    layers.section_layers(types.SimpleNamespace(layer_tokens="40", stack_backends="auto"))
    recs = {(r["name"], r["backend"]): r for r in timing.RECORDS}
    assert set(recs) == {("layer_stack_fwd_bwd_ms", "bf16"), ("layer_stack_fwd_bwd_ms", "auto"),
                         ("layer_stack_fwd_bwd_ms", "auto:separate"), ("stacked_projection_gain", "auto")}
    gain = recs[("stacked_projection_gain", "auto")]
    assert gain["output_bit_equal"] is True and gain["grad_sqnr_db_min"] > 20, gain
