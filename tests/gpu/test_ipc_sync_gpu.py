"""Weight sync through CUDA IPC (`jetrl_precision.ipc_sync`, `--vllm.sync_backend ipc`) between two processes on one
GPU, as a Ray hybrid engine runs it: the trainer packs FP8 bytes + scales and bf16 tensors into buckets on its GPU and
exports them; another process maps each bucket, and what it reads has the trainer's digests. The bucket's memory is
then reused for the next sync, and the reader sees the new bytes."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gpu_testutil import outlier_data, requires_cuda_reason
from jetrl_precision import get_recipe, ops
from jetrl_precision.weight_sync import SyncStats, SyncTensor, WeightSyncError, pack_sync_buckets, sync_tensor_digest

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=requires_cuda_reason)

ROOT = Path(__file__).resolve().parents[2]

# The engine side: map every bucket, read its tensors, answer their digests; a bucket from a GPU it is not on is refused.
READER = textwrap.dedent("""
    import json, pickle, sys
    import torch
    from jetrl_precision.ipc_sync import bucket_for, mapped_bucket
    from jetrl_precision.weight_sync import WeightSyncError, sync_tensor_digest, unpack_sync_bucket

    device = torch.device("cuda", 0)
    digests, refused = {}, ""
    for entries, bucket in pickle.load(open(sys.argv[1], "rb")):
        with mapped_bucket({"GPU-another": bucket, bucket.device_uuid: bucket}, device, "reader") as payload:
            digests.update({t.name: sync_tensor_digest(t) for t in unpack_sync_bucket(entries, payload)})
        del payload  # lets the trainer's process reuse the memory (an engine's install returns, which does the same)
    try:
        bucket_for({"GPU-not-this-one": bucket}, device, "reader")
    except WeightSyncError as e:
        refused = str(e)
    print(json.dumps({"digests": digests, "refused": refused}))
""")


def _tensors(seed: int) -> list[SyncTensor]:
    fmt = get_recipe("jet_fp8").train_fprop.weight
    out = []
    for i, (n, k) in enumerate([(1024, 576), (384, 1152), (130, 200)]):
        qt = ops.quantize(outlier_data(n, k, seed=seed + i), fmt)
        out.append(SyncTensor(f"layers.{i}.mlp.weight", qt.data, qt.scale, qt.block))
        out.append(SyncTensor(f"layers.{i}.norm.weight", outlier_data(1, k, seed=seed + 10 + i).reshape(-1)))
    return out


def _sync(tmp_path: Path, tensors: list[SyncTensor]) -> dict:
    from jetrl_precision.ipc_sync import share_bucket

    stats = SyncStats()
    packed = list(pack_sync_buckets(tensors, "cuda", bucket_bytes=400_000, stats=stats))
    assert stats.buckets >= 2 and stats.fp8_tensors == 3
    shared = [(entries, share_bucket(payload)) for entries, payload in packed]  # the payloads stay alive meanwhile
    f = tmp_path / "buckets.pkl"
    f.write_bytes(pickle.dumps(shared))
    p = subprocess.run([sys.executable, "-c", READER, str(f)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]
    del packed, shared
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_another_process_reads_the_trainers_bytes_through_cuda_ipc(tmp_path):
    for seed in (0, 100):  # the second sync reuses the first one's memory (the caching allocator)
        sent = _tensors(seed)
        got = _sync(tmp_path, sent)
        assert got["digests"] == {t.name: sync_tensor_digest(t) for t in sent}
        assert "no policy rank shares this engine's GPU" in got["refused"] and "--vllm.sync_backend gloo" in got["refused"]


def test_a_bucket_opened_on_another_gpu_is_refused():
    from jetrl_precision.ipc_sync import CudaIpcBucket, open_bucket

    with pytest.raises(WeightSyncError, match="was exported from GPU GPU-elsewhere"):
        open_bucket(CudaIpcBucket("GPU-elsewhere", ()), "cuda")
