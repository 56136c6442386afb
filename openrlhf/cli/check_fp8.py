"""Check a model before an FP8 run: per-layer FP8 error and rollout-train mismatch per recipe.

    python -m openrlhf.cli.check_fp8 --model PATH [--prompt_data FILE --input_key prompt --apply_chat_template]
                                     [--recipes bf16 jet_fp8 fp8_rollout jet_fp8+kv8] [--out DIR] [--strict]

Three questions, answered on the user's own model and prompts:
1. Does any linear lose too much to FP8? For every layer the recipe converts, the SQNR of its
   FP8 forward output and (with an FP8 backward) of dX and dW against float64, on the layer's real
   input (`jetrl_precision.diagnostics`). Outlier channels show as a high peak/RMS and a low SQNR.
2. Is each recipe on-policy here? The transformers rollout engine samples with the recipe's
   rollout numerics and the trainer recomputes the logprobs with its training numerics: the same
   `rollout_train_mismatch/*` a run logs every step, before the run.
3. How far does the recipe's training policy sit from the high-precision one? The trainer's
   logprobs under the recipe against the unconverted model's, on the same tokens.
A recipe `NAME+kv8` runs NAME with the e4m3 KV cache (`--precision.kv_cache e4m3`); with one in --recipes the report
also gives the share of the model's keys and values that e4m3 at scale 1 holds poorly (below its smallest normal, or
saturated past 448), measured on the prompts.

Prints a report, writes check_fp8.json and check_fp8.md to --out, exits 0. With --strict it exits 1
when a layer is flagged (SQNR below --min_sqnr_db, or more than --max_subnormal_frac of its inputs
below e4m3's smallest normal after scaling: the mark of outlier channels). Bad input (missing model, unknown recipe) exits 2 with the reason.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from openrlhf.utils.process import exit_after_run  # noqa: E402

__all__ = ["main", "run_check"]

logger = logging.getLogger("openrlhf.check_fp8")

# Used when no --prompt_data is given: short, varied, model-agnostic.
DEFAULT_PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain why the sky is blue in one sentence.",
    "12 * 7 + 3 =",
    "Translate to German: The weather is nice today.",
    "List three prime numbers greater than 50:",
    "Once upon a time, in a small village,",
)
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m openrlhf.cli.check_fp8", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # The training CLI's spellings work too, so a run's flags can be pasted as they are.
    p.add_argument("--model", "--pretrain", "--actor.model_name_or_path", dest="model", required=True, help="HF model folder")
    p.add_argument("--recipes", nargs="+", default=["bf16", "jet_fp8", "fp8_rollout"], help="recipes whose mismatch to measure")
    p.add_argument("--diagnose_recipe", default="jet_fp8", help="recipe whose FP8 linears get the per-layer SQNR")
    p.add_argument("--prompt_data", "--data.prompt_dataset", dest="prompt_data", default=None,
                   help="prompt file/folder as for training (default: 8 built-in prompts)")
    p.add_argument("--input_key", "--data.input_key", dest="input_key", default="input")
    p.add_argument("--apply_chat_template", "--data.apply_chat_template", dest="apply_chat_template", action="store_true")
    p.add_argument("--n_prompts", type=int, default=8)
    p.add_argument("--n_samples", type=int, default=2, help="samples per prompt")
    p.add_argument("--max_new_tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument("--attn_implementation", default="sdpa", help="sdpa, eager or jetrl_invariant (batch-invariant, CPU)")
    p.add_argument("--engine", choices=["auto", "hf", "vllm"], default="auto",
                   help="rollout engine to measure: auto = vllm on a GPU when installed, else the transformers engine")
    p.add_argument("--vllm_gpu_memory_utilization", type=float, default=0.3)
    p.add_argument("--gemm_backend", default="auto")
    p.add_argument("--min_sqnr_db", type=float, default=20.0, help="flag layers whose worst SQNR is below this")
    p.add_argument("--max_subnormal_frac", type=float, default=0.01,
                   help="flag layers with more of their nonzero inputs below e4m3's smallest normal after scaling")
    p.add_argument("--max_tokens", type=int, default=2048, help="tokens per layer for the SQNR measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for check_fp8.json / check_fp8.md")
    p.add_argument("--strict", action="store_true", help="exit 1 if any layer is flagged")
    return p


def _named_recipe(r: str, kv8_allowed: bool = True):
    """The recipe `NAME` or `NAME+kv8` (NAME with the e4m3 KV cache) names; ValueError for anything else."""
    from jetrl_precision import RECIPE_NAMES, get_recipe

    name, _, suffix = r.partition("+")
    if name not in RECIPE_NAMES or suffix not in (("", "kv8") if kv8_allowed else ("",)):
        raise ValueError(f"unknown recipe {r!r}; choose from {', '.join(RECIPE_NAMES)}, each with +kv8 for the e4m3 KV cache")
    recipe = get_recipe(name)
    return recipe.replace(kv_cache="e4m3") if suffix else recipe


def _validate(a: argparse.Namespace) -> None:
    if not (Path(a.model) / "config.json").is_file():
        raise ValueError(f"--model {a.model}: no config.json there (expected a Hugging Face model folder)")
    for r in a.recipes:
        _named_recipe(r)
    _named_recipe(a.diagnose_recipe, kv8_allowed=False)
    for name in ("n_prompts", "n_samples", "max_new_tokens", "max_tokens"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(a, name)}")
    if a.prompt_data is not None and not Path(a.prompt_data).exists():
        raise ValueError(f"--prompt_data {a.prompt_data}: no such file or folder")


def _engine_choice(a: argparse.Namespace, device) -> str:
    if a.engine == "auto":
        import importlib.util

        return "vllm" if device.type == "cuda" and importlib.util.find_spec("vllm") is not None else "hf"
    if a.engine == "vllm":
        from openrlhf.trainer.engines.vllm_engine import require_vllm

        require_vllm()
        if device.type != "cuda" and a.dtype != "fp32":
            raise ValueError("--engine vllm on CPU runs in fp32 only (vLLM-CPU); pass --dtype fp32")
    return a.engine


def _make_engine(a: argparse.Namespace, kind: str, recipe, dtype, device, max_len: int):
    if kind == "vllm":
        from openrlhf.trainer.engines.vllm_engine import VLLMEngine

        return VLLMEngine(
            a.model, recipe, dtype=DTYPES[a.dtype], seed=a.seed, gpu_memory_utilization=a.vllm_gpu_memory_utilization,
            max_model_len=max_len,
        )
    from openrlhf.trainer.engines.hf_engine import HFEngine

    return HFEngine(a.model, recipe, dtype=dtype, device=device, attn_implementation=a.attn_implementation)


def _prompt_ids(a: argparse.Namespace, tokenizer) -> list[list[int]]:
    if a.prompt_data is None:
        texts = list(DEFAULT_PROMPTS)
        if a.apply_chat_template:
            texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True) for t in texts]
    else:
        from openrlhf.datasets.prompts_dataset import PromptDataset, load_prompt_records

        records = load_prompt_records(a.prompt_data, max_samples=a.n_prompts)
        texts = [it["prompt"] for it in PromptDataset(records, tokenizer, input_key=a.input_key, apply_chat_template=a.apply_chat_template)]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts[: a.n_prompts]]
    ids = [x for x in ids if x]
    if not ids:
        raise ValueError("every prompt tokenized to nothing")
    return ids


def _recipe_mismatch(a, recipe_name: str, dtype, device, prompts, hp_model, engine_kind: str) -> dict:
    """Engine (rollout numerics) samples, trainer (training numerics) recomputes, as in a run's first step."""
    import torch

    from jetrl_precision import convert_to_fp8, mismatch_metrics
    from openrlhf.models.actor import Actor, load_causal_lm
    from openrlhf.trainer.engines.base import SamplingConfig
    from openrlhf.trainer.ppo_utils.experience_maker import sample_after_sync

    recipe = _named_recipe(recipe_name)
    if a.gemm_backend != "auto":
        import dataclasses

        recipe = dataclasses.replace(recipe, gemm_backend=a.gemm_backend)
    trainer = convert_to_fp8(load_causal_lm(a.model, dtype, a.attn_implementation).to(device), recipe, side="train").eval()
    engine = _make_engine(a, engine_kind, recipe, dtype, device, max(map(len, prompts)) + a.max_new_tokens + 1)
    pad = hp_model.config.pad_token_id if hp_model.config.pad_token_id is not None else (hp_model.config.eos_token_id or 0)
    sampling = SamplingConfig(max_new_tokens=a.max_new_tokens, temperature=a.temperature, n=a.n_samples, seed=a.seed + 1)
    try:
        exp = sample_after_sync(trainer, engine, recipe, prompts, sampling, pad if isinstance(pad, int) else pad[0])
    finally:
        engine.shutdown()  # one in-process vLLM engine at a time
    seq, attn, mask = exp.sequences.to(device), exp.attention_mask.to(device), exp.action_mask
    with torch.no_grad():
        train_lp = Actor(trainer)(seq, attn, exp.num_actions).float().cpu()
        hp_lp = Actor(hp_model)(seq, attn, exp.num_actions).float().cpu()
    on_policy = mismatch_metrics(exp.rollout_logprobs.float(), train_lp, mask)
    shift = mismatch_metrics(hp_lp, train_lp, mask)
    del trainer, engine
    return {
        "recipe": recipe_name,
        "engine": engine_kind,
        "tokens": int(mask.sum()),
        "rollout_train": {k: on_policy[k] for k in ("abs_logp_diff_mean", "abs_logp_diff_max", "kl_k3", "ratio_outside_0.8_1.25")},
        "train_vs_high_precision": {k: shift[k] for k in ("abs_logp_diff_mean", "abs_logp_diff_max", "kl_k3")},
    }


def run_check(a: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoTokenizer

    from jetrl_precision.diagnostics import diagnose_linears, format_diagnostics
    from openrlhf.models.actor import load_causal_lm

    _validate(a)
    device = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else ("cpu" if a.device == "auto" else a.device))
    dtype = getattr(torch, DTYPES[a.dtype])
    engine_kind = _engine_choice(a, device)
    torch.manual_seed(a.seed)
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    prompts = _prompt_ids(a, tokenizer)
    hp = load_causal_lm(a.model, dtype, a.attn_implementation).to(device).eval()

    # 1. Per-layer FP8 error on the model's own activations (prompts padded on the left, as the engine does).
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    logger.info("check_fp8: per-layer SQNR under %s on %d prompts (%d tokens)", a.diagnose_recipe, len(prompts), int(attn.sum()))
    diags = diagnose_linears(
        hp, a.diagnose_recipe, lambda: hp(input_ids=ids, attention_mask=attn), gemm_backend=a.gemm_backend, max_tokens=a.max_tokens, seed=a.seed
    )
    flagged = {d.fqn: d.problems(a.min_sqnr_db, a.max_subnormal_frac) for d in diags}
    flagged = {k: v for k, v in flagged.items() if v}
    coverage = _coverage(hp, a.diagnose_recipe)
    kv = None
    if any(r.endswith("+kv8") for r in a.recipes):
        from jetrl_precision.kv_cache import kv_value_stats

        kv = kv_value_stats(hp, lambda: hp(input_ids=ids, attention_mask=attn))

    # 2 + 3. Mismatch per recipe.
    recipes = []
    for i, name in enumerate(a.recipes):
        logger.info("check_fp8: recipe %s (%d/%d): %s engine samples %d x %d x %d tokens", name, i + 1, len(a.recipes), engine_kind,
                    len(prompts), a.n_samples, a.max_new_tokens)
        recipes.append(_recipe_mismatch(a, name, dtype, device, prompts, hp, engine_kind))

    report = {
        "model": str(a.model), "dtype": a.dtype, "device": str(device), "attn_implementation": a.attn_implementation, "engine": engine_kind,
        "diagnose_recipe": a.diagnose_recipe, "min_sqnr_db": a.min_sqnr_db, "max_subnormal_frac": a.max_subnormal_frac,
        "layers": [d.to_dict() for d in diags], "flagged_layers": flagged, "recipes": recipes, "fp8_coverage": coverage,
        "kv_cache_e4m3": kv,
        "seconds": round(time.perf_counter() - t0, 1),
        "diagnostics_table": format_diagnostics(diags, a.min_sqnr_db, a.max_subnormal_frac),
    }
    return report


def _fmt_recipes(recipes: list[dict]) -> str:
    lines = [
        "| recipe | engine | tokens | rollout-train mean abs dlogp | max | k3 KL | ratio outside [0.8, 1.25] | train vs high-precision mean abs dlogp |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in recipes:
        o, s = r["rollout_train"], r["train_vs_high_precision"]
        lines.append(
            f"| {r['recipe']} | {r['engine']} | {r['tokens']} | {o['abs_logp_diff_mean']:.3g} | {o['abs_logp_diff_max']:.3g} | {o['kl_k3']:.3g} "
            f"| {o['ratio_outside_0.8_1.25']:.3g} | {s['abs_logp_diff_mean']:.3g} |"
        )
    return "\n".join(lines)


def _coverage(model, recipe_name: str) -> dict:
    """What share of the model's weight matrices the recipe's conversion puts in FP8 (converted on a meta-device
    copy built from the model's config: no memory, the model itself untouched)."""
    import torch
    from transformers import AutoModelForCausalLM

    from jetrl_precision import convert_to_fp8, fp8_coverage, get_recipe

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(model.config)
    cov = fp8_coverage(convert_to_fp8(meta, get_recipe(recipe_name), fuse_swiglu=False))
    return {"summary": cov.summary(), "fp8_share": cov.share(cov.fp8), "other_modules": list(cov.other_modules[:5]),
            "other_share": cov.share(cov.other)}


def _verdict(report: dict) -> str:
    by = {r["recipe"]: r["rollout_train"]["abs_logp_diff_mean"] for r in report["recipes"]}
    out = [f"FP8 coverage ({report['diagnose_recipe']}): {report['fp8_coverage']['summary']}"]
    low = list(report["flagged_layers"])
    out.append(
        f"FP8 error: {len(low)} of {len(report['layers'])} layers flagged"
        + (f" ({', '.join(low[:5])}{', ...' if len(low) > 5 else ''}); to keep them high precision, add their names to a "
           "recipe's keep_high_precision (docs/precision.md, Recipes)" if low else "")
    )
    if by:
        out.append("rollout-train mean |dlogp|: " + ", ".join(f"{k} {v:.3g}" for k, v in by.items())
                   + (" (bf16 is this engine's float-noise floor at this dtype)" if "bf16" in by else ""))
    kv = report.get("kv_cache_e4m3")
    if kv:
        out.append(
            f"e4m3 KV cache: {100 * kv['below_normal_frac']:.2f}% of the keys and values fall below e4m3's smallest normal "
            f"(2^-6: relative error above 1/16) and {100 * kv['saturated_frac']:.3f}% past 448 (saturated), of "
            f"{kv['values']:,} on these prompts; compare the +kv8 rows' train-vs-high-precision shift with their base's"
        )
    if "jet_fp8" in by and "fp8_rollout" in by:
        ratio = by["fp8_rollout"] / by["jet_fp8"] if by["jet_fp8"] > 0 else math.inf
        out.append(f"on-policy: jet_fp8 is {ratio:.1f}x closer to its trainer than fp8_rollout")
    # bf16's mismatch is the engine's float noise; at twice that, FP8 rounding's amplification of it is most of jet_fp8's.
    if "jet_fp8" in by and "bf16" in by and by["jet_fp8"] > 2 * max(by["bf16"], 1e-9):
        out.append(
            f"jet_fp8's mismatch is {by['jet_fp8'] / max(by['bf16'], 1e-9):.1f}x bf16's: the engine's kernels and the trainer's "
            "full forward differ by float noise that FP8 rounding amplifies; --precision.bitwise makes every sampled "
            "token's log-prob equal the trainer's (docs/precision.md, Bitwise mode)"
        )
    return "\n".join(out)


def _finite(v):
    """JSON has no inf/nan: an exact (infinite-SQNR) value is written as null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return v


def main(argv: Sequence[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        report = run_check(a)
    except (ValueError, FileNotFoundError, KeyError, ImportError) as e:
        print(f"error: {e.args[0] if isinstance(e, KeyError) and e.args else e}", file=sys.stderr)
        return 2
    text = "\n\n".join(["## Per-layer FP8 error (worst first)", report["diagnostics_table"], "## Rollout-train mismatch per recipe", _fmt_recipes(report["recipes"]), "## Verdict", _verdict(report)])
    print(text)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "check_fp8.json").write_text(json.dumps(_finite(report), indent=1, allow_nan=False))
        (out / "check_fp8.md").write_text(f"# FP8 check of {report['model']}\n\n{text}\n")
        print(f"\nwrote {out / 'check_fp8.json'} and {out / 'check_fp8.md'} ({report['seconds']} s)")
    if a.strict and report["flagged_layers"]:
        print(f"strict: {len(report['flagged_layers'])} layer(s) flagged (SQNR below {a.min_sqnr_db} dB or subnormal inputs "
              f"above {a.max_subnormal_frac})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    exit_after_run(main())
