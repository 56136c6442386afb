"""One job of tests/gpu/test_kv_cache_gpu.py, in its own process (vLLM keeps GPU memory until its process ends).

    python tests/gpu/kv_cache_job.py --model DIR --recipe jet_fp8+kv8 --out result.json

A jet_fp8 engine in vLLM's default mode, with the e4m3 KV cache (`jet_fp8+kv8`: `--precision.kv_cache e4m3`, vLLM's
FP8 cache on Triton attention) or without it (`jet_fp8`, the baseline), and the trainer's model of the same recipe on
the GPU: the engine's rollout graph, and the sampled tokens' log-probs against the trainer's recompute (for kv8 with
the KV mirror on and off).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--recipe", choices=["jet_fp8", "jet_fp8+kv8"], default="jet_fp8+kv8")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=256)
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from jetrl_precision import PrecisionGraph, build_precision_graph, check_subgraph, convert_to_fp8, get_recipe
    from jetrl_precision.kv_cache import unmirror_kv_cache
    from openrlhf.trainer.engines.base import SamplingConfig
    from openrlhf.trainer.engines.vllm_engine import VLLMEngine

    kv8 = a.recipe.endswith("+kv8")
    recipe = get_recipe("jet_fp8").replace(kv_cache="e4m3" if kv8 else "auto")
    # a fixed KV cache, not one sized by profiling free memory: the test starts both recipes' engines at once
    engine = VLLMEngine(a.model, recipe, dtype="bfloat16", seed=0, gpu_memory_utilization=0.3, max_model_len=2048,
                        engine_kwargs={"kv_cache_memory_bytes": 2 << 30})
    rollout = PrecisionGraph.from_dict(engine.precision_graph())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (int(n),), generator=g).tolist() for n in torch.randint(16, 64, (a.prompts,), generator=g)]
    out = engine.generate(prompts, SamplingConfig(max_new_tokens=a.new_tokens, temperature=1.0, seed=1))
    samples = [s for group in out for s in group]
    engine.shutdown()

    trainer = convert_to_fp8(AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16), recipe).cuda().eval()
    violations = [str(v) for v in check_subgraph(rollout, build_precision_graph(trainer, recipe, "train_fwd"))]

    def gaps() -> list[float]:
        res = []
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids], device="cuda")
            with torch.no_grad():
                lp = torch.log_softmax(trainer(input_ids=ids).logits[0].float(), -1)
            start = len(s.prompt_ids)
            ref = lp[start - 1 : -1].gather(-1, ids[0, start:, None])[:, 0].cpu()
            res += (ref - torch.tensor(s.logprobs)).abs().tolist()
        return res

    dlogp = gaps()  # for kv8: against the mirrored trainer
    result = {
        "job": "kv_cache", "recipe": a.recipe, "model": a.model, "kv_cache": rollout.meta.get("kv_cache"), "attention": rollout.meta.get("attention"),
        "violations": violations, "tokens": len(dlogp),
        "mean_abs_dlogp": sum(dlogp) / len(dlogp), "max_abs_dlogp": max(dlogp),
        "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
    }
    if kv8:  # the same samples against the trainer without the mirror: what the mirror removes
        unmirror_kv_cache(trainer)
        unmirrored = gaps()
        result.update(mean_abs_dlogp_unmirrored=sum(unmirrored) / len(unmirrored), max_abs_dlogp_unmirrored=max(unmirrored))
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
