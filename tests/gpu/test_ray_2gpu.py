"""Ray mode on 2 GPUs for real: policy rank(s), vLLM engine actors, NCCL between them.

- separate engine: `python -m openrlhf.cli.train_ppo_ray --fp8_unified --vllm.num_engines 1
  --actor.num_gpus_per_node 1`: the policy on one GPU, the engine on the other (different device
  UUIDs), the weight-sync group over NCCL, the FP8 bytes + scales of every step's sync counted
  against the trainer's own model, the digest check after every sync, and the precision check
  answered from inside the remote engine;
- colocated: `--train.colocate_all --vllm.enable_sleep`, 2 policy ranks and 2 engines sharing the
  2 GPUs, the engines asleep while training runs, weights over gloo or through CUDA IPC (`auto` picks it for --train.colocate_all);
- a tensor-parallel engine over both GPUs (colocated with 2 policy ranks): each worker installs its slice of
  the FP8 bytes (gloo or CUDA IPC), the digest check combines the slices;
- a layout that needs 3 GPUs is refused at once, naming the reference group;
- an engine actor killed mid-rollout: `EngineDiedError` naming it, and `--ckpt.load_enable`
  continues from the last checkpoint.

The model is a 2-layer Llama with head_dim 64 (FlashAttention-3 on sm90 has no head_dim 32 kernel),
built in the test. Engines run eager (no compile: the test measures nothing).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.integration]

if not torch.cuda.is_available():
    pytest.skip("needs CUDA GPUs", allow_module_level=True)
if torch.cuda.device_count() < 2:
    pytest.skip(f"needs 2 GPUs (the policy on one, the vLLM engine on the other); this machine has {torch.cuda.device_count()}",
                allow_module_level=True)
from ray_jobs import missing_modules  # noqa: E402

_missing = missing_modules()
if _missing:
    pytest.skip(f"needs {', '.join(_missing)} (benchmarks/h200x2_ray.sh install carries them)", allow_module_level=True)

import ray_jobs as rj  # noqa: E402
from _rl_helpers import kill_engine_mid_rollout  # noqa: E402
from ray_jobs import ENV  # noqa: E402

g = rj.g


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return rj.make_task(tmp_path_factory.mktemp("ray2gpu"))


def _expected_sync_bytes(model: Path) -> int:
    from transformers import AutoModelForCausalLM

    from jetrl_precision import convert_to_fp8, get_recipe
    from jetrl_precision.weight_sync import sync_nbytes

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    convert_to_fp8(m, get_recipe("jet_fp8"), side="train")
    return sync_nbytes(m, fp8=True)


def test_separate_engine_on_its_own_gpu_gets_fp8_bytes_over_nccl(task, tmp_path):
    out = tmp_path / "sep"
    p = rj.cli(rj.argv(task, out, ["--vllm.num_engines", "1", "--actor.num_gpus_per_node", "1", "--algo.kl.init_coef", "0"]))
    assert p.returncode == 0, p.stderr[-4000:]
    layout = json.loads((out / "ray_layout.json").read_text())
    assert layout["on_gpu"] and layout["sync_backend"] == "nccl" and layout["roles"] == {"policy": 1, "engines": 1}
    (pol,), (eng,) = layout["placement"]["policy"], layout["placement"]["engines"]
    assert pol["gpu_ids"] != eng["gpu_ids"] and pol["cuda_uuid"] != eng["cuda_uuid"], (pol, eng)
    assert pol["cuda_visible_devices"] == ",".join(pol["gpu_ids"]) and pol["cuda_device"] == 0  # cuda:0 is Ray's GPU for it
    steps = rj.metrics(out)
    assert [s["step"] for s in steps] == [1, 2]
    sent = _expected_sync_bytes(task[1])
    for s in steps:
        assert s["sync/checked_tensors"] >= 1, s  # the digest check after every sync
        assert s["sync/bytes"] == sent, (s["sync/bytes"], sent)  # e4m3 bytes + fp32 scales + bf16 rest, as the trainer holds them
        assert s["sync/seconds"] > 0 and s["perf/weight_sync_s"] >= s["sync/seconds"]
    summary = json.loads((out / "summary.json").read_text())
    report = summary["precision_report"]
    assert "[vllm-engine-0]" in report and "precision check: OK" in report, report[:2000]  # the graph came from the remote engine
    mism = [s["rollout_train_mismatch/abs_logp_diff_mean"] for s in steps]
    assert all(0 <= m < 0.5 for m in mism), mism


@pytest.mark.parametrize("backend", ["gloo", "auto"])
def test_colocated_engines_sleep_while_training_and_sync_over_gloo_or_cuda_ipc(task, tmp_path, backend):
    layout, steps = rj.hybrid_run(task, tmp_path / f"colo_{backend}", 2, backend)
    assert layout["groups"] == {"policy": 2}
    policy = [tuple(x["gpu_ids"]) for x in layout["placement"]["policy"]]
    engines = [tuple(x["gpu_ids"]) for x in layout["placement"]["engines"]]
    assert len(set(policy)) == 2 and sorted(engines) == sorted(policy), (policy, engines)  # engine i shares rank i's GPU
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["sync/checked_tensors"] >= 1 and s["perf/engine_wake_s"] > 0 and s["perf/engine_sleep_s"] > 0, s
        if "memory/train_engine_asleep_device_used_gib" in s and "memory/rollout_engine_awake_device_used_gib" in s:
            assert s["memory/train_engine_asleep_device_used_gib"] < s["memory/rollout_engine_awake_device_used_gib"] + 1.0, s


@pytest.mark.parametrize("backend", ["gloo", "auto"])
def test_tensor_parallel_engine_over_both_gpus_beside_two_policy_ranks(task, tmp_path, backend):
    """OpenRLHF's scripts' layout (--vllm.tensor_parallel_size 2 --train.colocate_all): one engine whose two workers
    (vLLM's Ray executor, in the engine's bundles) share the policy ranks' GPUs. Every worker receives each sync (over
    gloo, or through CUDA IPC from the policy rank on its GPU) and installs its slice of the FP8 bytes; the digest
    check after every step combines the slices' sums."""
    # head_dim 128 and 2 KV heads: each worker's k/v slice is one 128-row FP8 block (the task's tiny model has 64)
    model = g.build_random_llama(tmp_path / "tp_model", {**g.TINY, "hidden_size": 512, "intermediate_size": 1024}, 2)
    out = tmp_path / f"tp_{backend}"
    p = rj.cli(rj.argv(task, out, ["--vllm.num_engines", "1", "--vllm.tensor_parallel_size", "2", "--actor.num_gpus_per_node", "2",
                               "--train.colocate_all", "--algo.kl.init_coef", "0", "--vllm.gpu_memory_utilization", "0.2",
                               "--vllm.sync_backend", backend],
                   model=model))
    assert p.returncode == 0, p.stderr[-4000:]
    layout = json.loads((out / "ray_layout.json").read_text())
    assert layout["groups"] == {"policy": 2} and layout["roles"]["engines"] == 1
    summary = json.loads((out / "summary.json").read_text())
    assert "tensor_parallel_workers: 2" in summary["precision_report"] and "precision check: OK" in summary["precision_report"]
    steps = rj.metrics(out)
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["sync/checked_tensors"] >= 1 for s in steps)  # a digest mismatch stops the run
    assert max(s["rollout_train_mismatch/abs_logp_diff_mean"] for s in steps) < 0.5  # random weights, bf16: loose


def test_layout_needing_more_gpus_than_the_machine_has_is_refused_at_once(task, tmp_path):
    t0 = time.time()
    p = rj.cli(rj.argv(task, tmp_path / "ref", ["--vllm.num_engines", "1", "--actor.num_gpus_per_node", "1", "--algo.kl.init_coef", "0.01"]),
             timeout=180)
    assert p.returncode == 1 and "needs 3 GPUs and the cluster has 2" in p.stderr and "colocate_actor_ref" in p.stderr, p.stderr[-2000:]
    assert time.time() - t0 < 120  # not the placement group's 600 s wait


# ---- last: this one drives Ray in the test's own process ---------------------------------------------------
@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ENV["PYTHONPATH"]}})
    yield ray
    ray.shutdown()


def test_killed_engine_is_named_and_the_run_resumes_from_its_checkpoint(task, tmp_path, ray_local):
    from openrlhf.config import parse_config
    from openrlhf.trainer.ray import EngineDiedError, run_ray

    out = tmp_path / "kill"
    os.environ.update({k: v for k, v in ENV.items() if k.startswith(("VLLM_", "NCCL_", "TORCH_", "NVSHMEM_"))})
    cfg = parse_config(rj.argv(task, out, ["--vllm.num_engines", "1", "--actor.num_gpus_per_node", "1", "--algo.kl.init_coef", "0",
                                         "--ckpt.save_steps", "1"], steps=4, new_tokens=128))  # a rollout long enough to catch
    killed: dict = {}
    killer = threading.Thread(target=kill_engine_mid_rollout, args=(ray_local, "-vllm-engine-0", 3, killed, 400.0),
                              daemon=True)
    killer.start()
    with pytest.raises(EngineDiedError) as info:
        run_ray(cfg, evaluate=False)
    killer.join(timeout=30)
    err = info.value
    at = killed.get("killed_at_call", 0)  # one rollout per step: call k is step k's, after step k-1's checkpoint
    assert at in (3, 4), killed
    assert err.engine_id == "vllm-engine-0" and err.during.startswith("generate") and "--ckpt.load_enable" in str(err), str(err)
    ckpt = out / "checkpoints_ppo" / "actor"
    assert (ckpt / "latest").read_text().strip() == f"global_step{at - 1}"
    resumed = run_ray(dataclasses.replace(cfg, ckpt=dataclasses.replace(cfg.ckpt, load_enable=True)), evaluate=False)
    assert resumed["steps"] == 4 and resumed["sync_backend"] == "nccl"
    assert [s["step"] for s in rj.metrics(out)] == list(range(at, 5))
    assert (ckpt / "latest").read_text().strip() == "global_step4"
