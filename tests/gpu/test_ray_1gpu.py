"""Ray's hybrid engine on one GPU for real: `python -m openrlhf.cli.train_ppo_ray --fp8_unified --vllm.num_engines 1
--actor.num_gpus_per_node 1 --train.colocate_all --vllm.enable_sleep`, the policy rank and the vLLM engine actor sharing
the GPU, the engine asleep while training runs. Weights sync over gloo (`--vllm.sync_backend gloo`) or through CUDA
IPC (`auto` picks it for --train.colocate_all on GPUs), with the digest check after every sync and the precision
check answered from inside the engine. It needs one GPU (a lent single H200 or H100) and Ray, vLLM and DeepSpeed
(`benchmarks/h200x2_ray.sh install`).
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.integration]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
from ray_jobs import missing_modules  # noqa: E402

_missing = missing_modules()
if _missing:
    pytest.skip(f"needs {', '.join(_missing)} (benchmarks/h200x2_ray.sh install carries them)", allow_module_level=True)

import ray_jobs as rj  # noqa: E402


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return rj.make_task(tmp_path_factory.mktemp("ray1gpu"))


@pytest.mark.parametrize("backend", ["gloo", "auto"])
def test_hybrid_engine_on_one_gpu_sleeps_while_training_and_syncs_over_gloo_or_cuda_ipc(task, tmp_path, backend):
    layout, steps = rj.hybrid_run(task, tmp_path / f"hybrid_{backend}", 1, backend)
    (pol,), (eng,) = layout["placement"]["policy"], layout["placement"]["engines"]
    assert pol["cuda_uuid"] == eng["cuda_uuid"], (pol, eng)  # one GPU, two processes
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["sync/checked_tensors"] >= 1 and s["sync/bytes"] > 0, s  # a digest mismatch stops the run
        assert s["perf/engine_wake_s"] > 0 and s["perf/engine_sleep_s"] > 0, s
    report = json.loads((tmp_path / f"hybrid_{backend}" / "summary.json").read_text())["precision_report"]
    assert "[vllm-engine-0]" in report and "precision check: OK" in report, report[:2000]
    assert max(s["rollout_train_mismatch/abs_logp_diff_mean"] for s in steps) < 0.5  # random weights: loose
