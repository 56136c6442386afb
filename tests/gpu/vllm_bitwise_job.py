"""One job of the vLLM bitwise GPU test, in its own process (vLLM keeps GPU memory until its process ends).

    python tests/gpu/vllm_bitwise_job.py --model DIR --recipe jet_fp8 --new-tokens 1024 --out result.json

A bitwise `VLLMEngine` (vLLM's default mode: torch.compile + CUDA graphs) samples 16 prompts at T=1 and returns each
sampled token's log-prob; it shuts down, and the trainer-side model of the same recipe, converted as the trainer
converts it (`convert_to_fp8` + `make_batch_invariant`), recomputes them through the `Actor` (padded and packed).
The JSON holds both and where they differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / "tests", ROOT / "tests" / "gpu"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def _prompts(tok, model_cfg, n: int) -> list[list[int]]:
    """Chat prompts where the tokenizer has a template (SmolLM2), else random token ids (the tiny model)."""
    if tok.chat_template is not None:
        from vllm_jobs import chat_prompts

        return chat_prompts(tok, n)
    import torch

    g = torch.Generator().manual_seed(7)
    return [torch.randint(4, model_cfg.vocab_size, (int(k),), generator=g).tolist() for k in torch.randint(5, 60, (n,), generator=g)]


def _differences(engine_lp, trainer_lp, mask) -> dict:
    import torch

    differ = (engine_lp.view(torch.int32) != trainer_lp.view(torch.int32)) & mask
    where = differ.nonzero().tolist()
    first = None
    if where:
        i, j = where[0]
        first = {"sequence": i, "position": j, "abs_dlogp": abs(float(engine_lp[i, j]) - float(trainer_lp[i, j]))}
    return {
        "tokens": int(mask.sum()), "differing_tokens": int(differ.sum()),
        "differing_sequences": sorted({i for i, _ in where}), "first": first,
        "first_position_per_sequence": {i: min(j for k, j in where if k == i) for i in sorted({i for i, _ in where})},
        "max_abs_dlogp": float(((engine_lp - trainer_lp).abs() * mask).max()) if mask.any() else 0.0,
    }


def run(a: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from jetrl_precision import convert_to_fp8, get_recipe
    from jetrl_precision.batch_invariant import make_batch_invariant
    from openrlhf.models.actor import Actor, load_causal_lm
    from openrlhf.trainer.engines.base import SamplingConfig
    from openrlhf.trainer.engines.vllm_engine import VLLMEngine
    from openrlhf.trainer.ppo_utils.experience_maker import samples_to_tensors

    recipe = dataclasses.replace(get_recipe(a.recipe), gemm_backend="triton_invariant")
    cfg = AutoConfig.from_pretrained(a.model)
    tok = AutoTokenizer.from_pretrained(a.model)
    prompts = _prompts(tok, cfg, a.prompts)
    t0 = time.perf_counter()
    engine = VLLMEngine(
        a.model, recipe, dtype="bfloat16", seed=0, gpu_memory_utilization=a.gpu_mem,
        max_model_len=min(max(map(len, prompts)) + a.new_tokens + 8, getattr(cfg, "max_position_embeddings", 1 << 20)),
        enforce_eager=False, engine_kwargs={"kv_cache_memory_bytes": int(a.kv_gib * (1 << 30))}, bitwise=True,
    )
    start_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    samples = [g[0] for g in engine.generate(prompts, SamplingConfig(max_new_tokens=a.new_tokens, temperature=1.0, n=1, seed=1, ignore_eos=a.ignore_eos))]
    gen_s = time.perf_counter() - t1
    engine.shutdown()

    trainer = convert_to_fp8(load_causal_lm(a.model, torch.bfloat16, "sdpa").cuda(), recipe, side="train")
    trainer = make_batch_invariant(trainer).eval()
    exp = samples_to_tensors(samples, pad_token_id=0)
    mask, rollout = exp.action_mask.bool(), exp.rollout_logprobs.float()
    res = {
        "recipe": a.recipe, "model": str(a.model), "mode": "default (torch.compile + CUDA graphs)",
        "start_seconds": round(start_s, 1), "generate_seconds": round(gen_s, 2), "prompts": len(prompts),
        "tokens": int(mask.sum()), "first_response_ids": samples[0].response_ids[:40], "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
    }
    for packing in (False, True):
        with torch.no_grad():
            lp = Actor(trainer, packing=packing)(exp.sequences.cuda(), exp.attention_mask.cuda(), exp.num_actions, temperature=1.0)
        res["packed" if packing else "padded"] = _differences(rollout, lp.float().cpu(), mask)
    from jetrl_precision.gemm import vendor_route

    if vendor_route.route_enabled():  # engine and trainer ran in this process: every shape either of them probed
        res["vendor_route"] = {k: v.passed for k, v in vendor_route.routes().items()}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--recipe", default="jet_fp8")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--gpu-mem", type=float, default=0.08)
    ap.add_argument("--kv-gib", type=float, default=3.0)
    ap.add_argument("--ignore-eos", action="store_true", help="sample every new token (a random model's EOS ends early)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: the plugin registers here
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    Path(a.out).write_text(json.dumps(run(a), indent=1))


if __name__ == "__main__":
    main()
