"""Rollout-train mismatch per recipe, with ordinary and batch-invariant numerics, by position.

For each recipe (bf16, jet_fp8, fp8_rollout) and attention (sdpa, jetrl_invariant) it builds a
trainer model (converted with the recipe's training flow) and a transformers rollout engine
(the recipe's rollout flow), syncs weights as training does, samples responses, recomputes
their logprobs with the trainer and reports `mismatch_metrics` — overall and per position
bucket — as JSON and a PNG.

    python benchmarks/mismatch_by_recipe.py --model runs/smollm2/model --chat --out docs/mismatch_smollm2
    python benchmarks/mismatch_by_recipe.py --out /tmp/mm_tiny          # a tiny random Llama built locally
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jetrl_precision import convert_to_fp8, get_recipe, mismatch_metrics  # noqa: E402
from openrlhf.models.actor import Actor, load_causal_lm  # noqa: E402
from openrlhf.trainer.engines.base import SamplingConfig  # noqa: E402
from openrlhf.trainer.engines.hf_engine import HFEngine  # noqa: E402
from openrlhf.trainer.ppo_utils.experience_maker import sample_after_sync  # noqa: E402

QUESTIONS = ["What is 3+4*2?", "Name three colors.", "Compute 12*13 step by step.", "Write a haiku about rain.",
             "Why is the sky blue?", "List the first five primes.", "What is 2 to the 10th power?", "Say hello in French."]


def measure(model: str, recipe_name: str, attn: str, prompts, a) -> dict:
    recipe = get_recipe(recipe_name)
    trainer = convert_to_fp8(load_causal_lm(model, torch.float32, attn), recipe, side="train").eval()
    engine = HFEngine(model, recipe, dtype=torch.float32, attn_implementation=attn)
    sampling = SamplingConfig(max_new_tokens=a.max_new_tokens, temperature=1.0, n=a.n, seed=0)
    exp = sample_after_sync(trainer, engine, recipe, prompts, sampling, engine.pad_token_id)
    with torch.no_grad():
        train_lp = Actor(trainer)(exp.sequences, exp.attention_mask, exp.num_actions)
    return mismatch_metrics(exp.rollout_logprobs, train_lp, exp.action_mask, bucket_size=a.bucket)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a local HF folder (default: build a tiny Llama)")
    p.add_argument("--chat", action="store_true", help="wrap prompts with the tokenizer's chat template")
    p.add_argument("--max_new_tokens", type=int, default=96)
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--bucket", type=int, default=16)
    p.add_argument("--out", default="mismatch_out")
    p.add_argument("--label", default=None, help="model name for the plot title")
    p.add_argument("--from_json", default=None, help="only re-plot an earlier mismatch.json")
    a = p.parse_args()
    if a.from_json:
        saved = json.loads(Path(a.from_json).read_text())
        plot(saved["results"], a.label or Path(saved["model"]).name, Path(a.out) / "mismatch.png")
        return
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = a.model
    if model is None:
        from openrlhf.utils.tiny_model import TinyModelSpec, build_tiny_model

        model = str(build_tiny_model(out / "tiny", TinyModelSpec(initializer_range=0.1, seed=3)))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    if a.chat:
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True) for q in QUESTIONS]
    else:
        prompts = QUESTIONS
    prompt_ids = [tok(t, add_special_tokens=False)["input_ids"] for t in prompts]
    results = {}
    for attn in ("sdpa", "jetrl_invariant"):
        for recipe in ("bf16", "jet_fp8", "fp8_rollout"):
            t0 = time.perf_counter()
            m = measure(model, recipe, attn, prompt_ids, a)
            results[f"{recipe}/{attn}"] = m
            print(f"{recipe:12s} {attn:16s} mean|dlogp| {m['abs_logp_diff_mean']:.3e}  max {m['abs_logp_diff_max']:.3e}  "
                  f"k3 {m['kl_k3']:.3e}  ({time.perf_counter() - t0:.0f}s)", flush=True)
    (out / "mismatch.json").write_text(json.dumps({"model": model, "args": vars(a), "results": results}, indent=1))

    plot(results, a.label or Path(model).name, out / "mismatch.png")
    print(f"wrote {out / 'mismatch.json'} and {out / 'mismatch.png'}")


def plot(results: dict, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    colors = {"bf16": "tab:blue", "jet_fp8": "tab:green", "fp8_rollout": "tab:red"}
    for ax, attn in zip(axes, ("sdpa", "jetrl_invariant")):
        for recipe, c in colors.items():
            m = results[f"{recipe}/{attn}"]
            buckets = sorted((int(k.split("/")[0][4:].split("-")[0]), v) for k, v in m.items() if k.startswith("pos_") and k.endswith("abs_logp_diff_mean"))
            xs, ys = [b[0] for b in buckets], [max(b[1], 1e-9) for b in buckets]
            ax.plot(xs, ys, "o-", color=c, label=f"{recipe} (mean {m['abs_logp_diff_mean']:.1e})")
        ax.set_yscale("log")
        ax.set_xlabel("response position (bucket start)")
        ax.set_title({"sdpa": "ordinary kernels (sdpa, KV-cached decode)", "jetrl_invariant": "batch-invariant numerics"}[attn], fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("mean |logp_rollout - logp_train| per token")
    fig.suptitle(f"rollout-train mismatch by recipe: {title}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
