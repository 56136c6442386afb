"""Where the GRPO actor update's time goes, kernel by kernel and host against GPU: bf16 against jet_fp8.

    python benchmarks/update_profile.py --out DIR [--layers 8] [--micro 4 8] [--variants plain deepspeed]
    python benchmarks/update_profile.py --from DIR [--record --command "..."]

In the end-to-end GRPO runs (benchmarks/grpo_vllm_gpu.py) the actor update gains far less from FP8 than the
reference forward or the decoder-layer stack benchmark do. This script runs the update's micro-step by itself, the
way the trainer runs it: a Llama-3.1-8B-shaped `LlamaForCausalLM` (random init, `--layers` layers, sdpa attention),
the trainer's `Actor` (log-probs of the response tokens from the full-vocabulary logits), its PPO `PolicyLoss` and
`aggregate_loss`, on micro-batches of `--micro` sequences of prompt + response tokens (prompts left-padded as
rollouts are), jet_fp8 converted by the trainer's `Fp8Converter`. Variants:

  plain      torch autograd, no optimizer: the forward and backward alone
  deepspeed  the trainer's DeepspeedStrategy (ZeRO-2, bf16, fused AdamW, gradient accumulation over the step),
             `engine.backward` / `engine.step`, and the trainer's per-micro-step host syncs (the loss's finiteness
             check before backward, the logged statistics after the step)
  deepspeed-nosync  the same without those syncs: what they cost
  deepspeed-zero1   `deepspeed` under ZeRO-1: on one GPU it partitions as little as ZeRO-2 (nothing), but accumulates
             the micro-steps' gradients in place instead of copying each into ZeRO-2's reduction buckets and back
  deepspeed-calling-thread  `deepspeed` with autograd's backward on the calling thread
             (`torch.autograd.set_multithreading_enabled(False)`) instead of its per-device worker thread: whether the
             GPU's idle time in jet_fp8's micro-step (host work of the FP8 backward) is the worker thread's

Per job (one recipe, variant and micro-batch size, each in its own process) it reports the wall time per micro-step
(steps back to back), the GPU kernel time per micro-step and its split by kernel group (torch.profiler / CUPTI,
`KERNEL_GROUPS`), the wall time of a no-grad log-prob forward (the old-logprob and reference passes), and the peak
memory. `--import-vllm restore|no-restore` imports vLLM's platform first, as a colocated engine does, with and without
the trainer's `restore_cudnn_sdpa`. Wall well above kernel time means the GPU waits on the host; a kernel group that FP8 does not shrink is
where the update's FP8 gain goes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from headline import job_device, recorded_device  # noqa: E402  (benchmarks/)
from vllm_decode_profile import category, kernel_times  # noqa: E402  (benchmarks/, no vLLM import)

__all__ = ["KERNEL_GROUPS", "kernel_group", "summarize", "record", "main"]

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
            max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)

# First match wins. cuBLAS(Lt) names its FP8 kernels with e4m3 or "qq" operand codes; BF16 ones are the rest of
# the GEMMs (in a jet_fp8 model: the lm_head and attention's batched products).
KERNEL_GROUPS = (
    ("attention", r"attn|attention|flash|fmha|cutlass.*kernel.*mem_eff|efficient"),
    ("quantize", r"quant|cast_transpose|requant"),
    ("gemm fp8", r"e4m3|f8f8|fp8|_qq|qqtst|scaled_mm"),
    ("gemm bf16", r"gemm|gemv|cutlass|xmma|nvjet|matmul|cublas|splitk"),
    ("norm", r"rms|norm|rsqrt"),
    ("log-softmax", r"softmax|logsumexp|log_softmax|gather|scatter"),
    ("optimizer", r"adam|multi_tensor|foreach|_amp_"),
    ("copy/fill", r"copy|fill|cat|index|zero"),
    ("elementwise", r"elementwise|reduce|unrolled|vectorized"),
)


def kernel_group(kernel: str) -> str:
    return category(kernel, KERNEL_GROUPS)


# ---- one job (the child process) -------------------------------------------------------------------
def _batch(micro: int, prompt_len: int, new_tokens: int, vocab: int, device, seed: int):
    """A rollout-shaped micro-batch: left-padded prompts (1/2 to full length) followed by full-length responses."""
    import torch

    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(3, vocab, (micro, prompt_len + new_tokens), generator=g)
    mask = torch.ones_like(seq)
    pads = torch.randint(0, prompt_len // 2 + 1, (micro,), generator=g)
    for i, p in enumerate(pads.tolist()):
        seq[i, :p], mask[i, :p] = 0, 0
    adv = torch.randn(micro, new_tokens, generator=g)
    return seq.to(device), mask.to(device), adv.to(device)


def job(a: argparse.Namespace) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import LlamaConfig, LlamaForCausalLM

    from jetrl_precision import Fp8Converter, get_recipe, mark_weights_updated
    from openrlhf.models.actor import Actor
    from openrlhf.models.loss import PolicyLoss, aggregate_loss

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if a.import_vllm:  # what a colocated engine does to the trainer's process (vllm/platforms/cuda.py on a GPU)
        from vllm.platforms import current_platform

        current_platform.is_cuda()
        if a.import_vllm == "no-restore":
            import openrlhf.models.actor as actor_mod

            actor_mod.restore_cudnn_sdpa = lambda: False
    cudnn_sdpa_after_import = torch.backends.cuda.cudnn_sdp_enabled()
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = TINY if a.tiny else LLAMA_8B
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=a.layers, attn_implementation="sdpa", **shape)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    base, _, mod = a.recipe.partition("+")
    if mod == "nativegemm":  # the torch backend's GEMM calls from the C++ extension (gemm.cublaslt_native)
        from jetrl_precision.gemm import cublaslt, cublaslt_native

        os.environ[cublaslt_native.ENV_SWITCH] = "1"
        print("gemm call:", cublaslt.call_status(device), flush=True)
    if base != "bf16":
        recipe = get_recipe(base)
        Fp8Converter(recipe if a.gemm_backend == "auto" else recipe.replace(gemm_backend=a.gemm_backend), side="train",
                     cache_weights=not a.requantize_weights, fuse_rmsnorm=mod != "plainnorm").convert(model)
        if mod == "plaindy":  # gate/up's dY quantized by the GEMM's own quantizer, after the SwiGLU backward
            from jetrl_precision.swiglu import set_dy_quantization

            set_dy_quantization(model, False)
    if a.liger:  # the trainer's --ds.use_liger_kernel: after the conversion, as there
        from openrlhf.models.liger import apply_liger_kernels

        apply_liger_kernels(model)
    actor = Actor(model)
    if a.grad_ckpt:
        actor.gradient_checkpointing_enable()
    loss_fn = PolicyLoss(0.2, 0.2)
    batches = [_batch(a.micro, a.prompt_len, a.new_tokens, shape["vocab_size"], device, seed=i) for i in range(4)]
    steps_per_update = max(1, a.update_seqs // a.micro)
    global_tokens = float(a.update_seqs * a.new_tokens)

    engine, strategy = actor, None
    syncs = a.variant in ("deepspeed", "deepspeed-zero1", "deepspeed-calling-thread")
    if a.variant == "deepspeed-calling-thread":
        torch.autograd.set_multithreading_enabled(False)  # this job's process only
    if a.variant.startswith("deepspeed"):
        from openrlhf.utils.deepspeed.strategy import DeepspeedStrategy, StrategyConfig

        stage = 1 if a.variant == "deepspeed-zero1" else 2
        strategy = DeepspeedStrategy(StrategyConfig(zero_stage=stage, micro_batch_size=a.micro, train_batch_size=a.update_seqs,
                                                    gradient_checkpointing=a.grad_ckpt))
        strategy.setup_distributed()
        opt = strategy.make_optimizer(actor, lr=1e-7, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
        engine = strategy.prepare(actor, opt)
    with torch.no_grad():
        old = [actor(s, m, a.new_tokens).float() for s, m, _ in batches]

    def micro_step(i: int) -> None:
        seq, mask, adv = batches[i % len(batches)]
        action_mask = mask[:, -a.new_tokens:]
        logp = engine(seq, mask, a.new_tokens)
        out = loss_fn(logp, old[i % len(batches)], adv, action_mask)
        loss = aggregate_loss(out.token_loss, action_mask, global_tokens, float(steps_per_update))
        if strategy is None:
            loss.backward()
            return
        if syncs and not torch.isfinite(loss):  # the trainer's check, a host sync before backward
            raise RuntimeError("non-finite loss")
        engine.backward(loss)
        engine.step()
        if engine.was_step_applied():
            mark_weights_updated()  # the trainer's post_optimizer_hook
        if syncs:  # the trainer's logged statistics: host syncs after the step
            float(out.token_loss.detach().sum().item()), float(out.clip_frac), float(out.approx_ratio_mean)

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for i in range(a.warmup):
        micro_step(i)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(a.steps):
        micro_step(i)
    sync()
    step_ms = 1e3 * (time.perf_counter() - t0) / a.steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for i in range(a.profile_steps):
            micro_step(i)
        sync()
    per_kernel = {k: v / a.profile_steps for k, v in kernel_times(prof, cuda).items()}
    groups: dict[str, float] = {}
    for k, us in per_kernel.items():
        groups[kernel_group(k)] = groups.get(kernel_group(k), 0.0) + us

    # The old-logprob / reference forward: no grad, the rollout's micro-batch of sequences.
    fwd_batch = _batch(a.fwd_micro, a.prompt_len, a.new_tokens, shape["vocab_size"], device, seed=99)
    with torch.no_grad():
        for _ in range(2):
            actor(fwd_batch[0], fwd_batch[1], a.new_tokens)
        sync()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            actor(fwd_batch[0], fwd_batch[1], a.new_tokens)
        sync()
    fwd_ms = 1e3 * (time.perf_counter() - t0) / a.steps
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:25]
    return {"job": "update_profile", "recipe": a.recipe, "variant": a.variant, "micro": a.micro, "layers": a.layers,
            "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "grad_ckpt": a.grad_ckpt, "gemm_backend": a.gemm_backend,
            "tiny": a.tiny, "import_vllm": a.import_vllm, "requantize_weights": a.requantize_weights, "liger": a.liger, "cudnn_sdpa_after_import": cudnn_sdpa_after_import,
            "cudnn_sdpa_in_steps": torch.backends.cuda.cudnn_sdp_enabled(),
            "autograd_worker_threads": torch._C._is_multithreading_enabled(), "kernels_captured": len(per_kernel), "micro_step_wall_ms": round(step_ms, 2),
            "micro_step_kernel_ms": round(sum(per_kernel.values()) / 1e3, 2),
            "groups_ms": {g: round(v / 1e3, 3) for g, v in sorted(groups.items(), key=lambda kv: -kv[1])},
            "fwd_nograd_ms": round(fwd_ms, 2), "fwd_micro": a.fwd_micro, "peak_allocated_gib": round(peak, 2),
            "top_kernels_us": [[k, round(v, 1), kernel_group(k)] for k, v in top], "date": time.strftime("%Y-%m-%d"),
            "device": job_device()}


# ---- the table ---------------------------------------------------------------------------------------
def _key(r: dict) -> tuple:
    return (r["gemm_backend"], r["variant"], r["micro"], r.get("grad_ckpt", False), r.get("import_vllm", ""),
            r.get("requantize_weights", False), r.get("liger", False))


def _settings_note(r: dict) -> str:
    """The job's non-default settings, as the table headings and the records' shapes name them."""
    vllm = {"": "", "restore": ", vLLM imported", "no-restore": ", vLLM imported (cuDNN attention left off)"}[r.get("import_vllm", "")]
    return (f"{vllm}{', FP8 weights re-quantized every call' if r.get('requantize_weights') else ''}"
            f"{', Liger kernels (--ds.use_liger_kernel)' if r.get('liger') else ''}")


def summarize(results: list[dict]) -> str:
    if not results:
        return "no profiles"
    r0 = results[0]
    lines = [f"Actor update micro-step, Llama-3.1-8B shape{' (tiny)' if r0.get('tiny') else ''}, {r0['layers']} layers, "
             f"prompt <= {r0['prompt_len']} + {r0['new_tokens']} response tokens per sequence", ""]
    groups = [g for g, _ in KERNEL_GROUPS] + ["other"]
    for key in sorted({_key(r) for r in results}):
        rows = [r for r in results if _key(r) == key]
        bf = next((r for r in rows if r["recipe"] == "bf16"), None)
        # one ratio column per FP8 recipe: an A/B such as jet_fp8 against jet_fp8+plainnorm reads side by side
        fp8 = [r for r in rows if r is not bf] if bf is not None else []
        lines += [f"{key[1]}, micro-batch {key[2]} sequences{', activation checkpointing' if key[3] else ''}, FP8 GEMMs {key[0]}"
                  f"{_settings_note(rows[0])}", "",
                  "| ms | " + " | ".join(r["recipe"] for r in rows) + "".join(f" | bf16 / {r['recipe']}" for r in fp8) + " |",
                  "|---" * (len(rows) + 1 + len(fp8)) + "|"]

        def row(label, get):
            vals = [get(r) for r in rows]
            ratios = "".join(f" | {get(bf) / get(r):.3f}" if get(r) and get(bf) else " | -" for r in fp8)
            return f"| {label} | " + " | ".join(f"{v:.1f}" for v in vals) + ratios + " |"

        lines.append(row("micro-step wall", lambda r: r["micro_step_wall_ms"]))
        lines.append(row("GPU kernels", lambda r: r["micro_step_kernel_ms"]))
        lines.append(row("wall - kernels (GPU idle)", lambda r: r["micro_step_wall_ms"] - r["micro_step_kernel_ms"]))
        for g in groups:
            if any(r["groups_ms"].get(g) for r in rows):
                lines.append(row(f"  {g}", lambda r, g=g: r["groups_ms"].get(g, 0.0)))
        lines.append(row(f"no-grad forward, {rows[0]['fwd_micro']} sequences", lambda r: r["fwd_nograd_ms"]))
        lines.append(row("peak allocated (GiB)", lambda r: r["peak_allocated_gib"]))
        lines.append("")
    for r in results:
        if not r["kernels_captured"]:
            lines.append(f"{r['recipe']} ({r['variant']}): the profiler recorded no GPU kernels (CUPTI unavailable?)")
    for r in results:
        if r["variant"] == "plain" and r["micro"] == min(x["micro"] for x in results) and not r["grad_ckpt"]:
            lines += [f"{r['recipe']} ({r['variant']}, micro {r['micro']}), top kernels per micro-step:"]
            lines += [f"  {us / 1e3:8.2f} ms  {g:12s} {name[:100]}" for name, us, g in r["top_kernels_us"][:14]]
    return "\n".join(lines)


def record(results: list[dict], device: str | None, command: str, runs_dir: Path | None = None) -> Path:
    """File the profiles as a benchmark run: per job, the micro-step's wall and kernel time and each kernel group.
    `device`: None takes the one the jobs recorded (`headline.recorded_device`)."""
    from headline import RUNS, write_run

    device = recorded_device(results, device, "update_profile")

    def flat(r: dict) -> dict[str, float]:
        return {"update_micro_step_wall_ms": r["micro_step_wall_ms"], "update_micro_step_kernel_ms": r["micro_step_kernel_ms"],
                "update_fwd_nograd_ms": r["fwd_nograd_ms"], "update_peak_allocated_gib": r["peak_allocated_gib"],
                **{f"update_micro_step_group_ms/{g}": v for g, v in r["groups_ms"].items()}}

    recs = []
    for r in results:
        bf = next((flat(x) for x in results if x["recipe"] == "bf16" and _key(x) == _key(r)), {})
        shape = (f"Llama-3.1-8B shape, {r['layers']} layers, {r['variant']}, micro-batch {r['micro']} x (<= {r['prompt_len']} + "
                 f"{r['new_tokens']}) tokens{', activation checkpointing' if r['grad_ckpt'] else ''}"
                 f"{'' if r['gemm_backend'] == 'torch' else ', FP8 GEMMs ' + r['gemm_backend']}"
                 f"{_settings_note(r)}")
        for key, v in flat(r).items():
            name, _, group = key.partition("/")
            ref = bf.get(key)
            unit = "GiB" if name.endswith("gib") else "ms"
            recs.append({"name": name, "shape": f"{shape}, {group}" if group else shape, "backend": r["recipe"], "value": v,
                         "unit": unit, "ratio_vs_bf16": round(ref / v, 4) if ref and v and unit == "ms" else None,
                         "command": command, "date": r["date"], "device": device, "gemm_backend": r["gemm_backend"],
                         **({"top_kernels_us": r["top_kernels_us"][:12]} if name == "update_micro_step_kernel_ms" else {})})
    return write_run(recs, "update-profile", results[0]["date"], runs_dir or RUNS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", default=["bf16", "jet_fp8"],
                    help="recipes to profile; <recipe>+plainnorm keeps the model's RMSNorms (--precision.plain_norms), "
                         "<recipe>+plaindy leaves gate/up's FP8 dY to the GEMM's own quantizer (swiglu.set_dy_quantization), "
                         "<recipe>+nativegemm runs the torch backend's GEMM calls from the C++ extension (JETRL_NATIVE_GEMM=1)")
    ap.add_argument("--variants", nargs="+", default=["plain", "deepspeed"], choices=["plain", "deepspeed", "deepspeed-nosync", "deepspeed-zero1", "deepspeed-calling-thread"])
    ap.add_argument("--micro", nargs="+", type=int, default=[4], help="sequences per training micro-batch")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256,
                    help="prompt tokens per sequence (left-padded). micro x (prompt + new tokens) is the GEMMs' M: the "
                         "trainer trims each micro-batch to its longest prompt, so its M is rarely a multiple of 128 "
                         "(WGrad's K); 256 and 64 give multiples, 40 does not")
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--update-seqs", type=int, default=256, help="sequences per optimizer step (the loss's normalization)")
    ap.add_argument("--fwd-micro", type=int, default=8, help="sequences per no-grad forward (the rollout micro-batch)")
    ap.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing, as --actor.gradient_checkpointing_enable")
    ap.add_argument("--gemm-backend", default=None, help="the FP8 GEMM backend (default: torch, cuBLASLt, on a GPU; auto on CPU)")
    ap.add_argument("--import-vllm", default="", choices=["", "restore", "no-restore"],
                    help="import vLLM's platform first, as a colocated engine does (on a GPU it switches cuDNN attention off "
                         "process-wide); no-restore also keeps the trainer from switching it back on")
    ap.add_argument("--requantize-weights", action="store_true",
                    help="FP8 layers keep no quantized weights between calls (--precision.requantize_weights)")
    ap.add_argument("--liger", action="store_true", help="Liger's kernels, as --ds.use_liger_kernel (CUDA and liger-kernel)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=240.0, help="per job")
    ap.add_argument("--tiny", action="store_true", help="a tiny model on CPU: checks the plumbing, measures nothing")
    ap.add_argument("--out", default="update_profile")
    ap.add_argument("--from", dest="from_dir", default=None)
    ap.add_argument("--record", action="store_true", help="with --from: file the profiles in benchmarks/results/runs")
    ap.add_argument("--device-name", default=None, help="--record: the device, for results that do not name it")
    ap.add_argument("--command", default="python benchmarks/update_profile.py")
    ap.add_argument("--recipe", default=None, help=argparse.SUPPRESS)  # one job (the child process)
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    from jetrl_precision import RECIPE_NAMES

    for r in a.recipes:
        base, plus, mod = r.partition("+")
        if base not in RECIPE_NAMES or (plus and (mod not in ("plainnorm", "plaindy", "nativegemm") or base == "bf16")):
            ap.error(f"--recipes {r}: a recipe ({', '.join(RECIPE_NAMES)}), or an FP8 one with +plainnorm, +plaindy or +nativegemm")
    if a.record and not a.from_dir:
        ap.error("--record files profiles already made: pass --from DIR (the folder a profile run wrote)")
    if a.liger and not a.from_dir:
        from openrlhf.models.liger import liger_missing

        if missing := liger_missing():
            ap.error(f"--liger needs a CUDA GPU with Liger: {missing}")
    if a.gemm_backend is None:
        import torch

        a.gemm_backend = "torch" if torch.cuda.is_available() else "auto"
    if a.recipe:
        a.micro = a.micro[0]
        Path(a.json).write_text(json.dumps(job(a), indent=1))
        return 0
    out = Path(a.from_dir or a.out)
    if not a.from_dir:
        out.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        for variant in a.variants:
            for micro in a.micro:
                for r in a.recipes:  # one at a time: each job has the GPU to itself
                    tag = (f"{variant}_m{micro}{'_ckpt' if a.grad_ckpt else ''}{'' if a.gemm_backend == 'torch' else '_' + a.gemm_backend}"
                           f"{'_vllm-' + a.import_vllm if a.import_vllm else ''}{'_requant' if a.requantize_weights else ''}"
                           f"{'_liger' if a.liger else ''}")
                    f = out / f"profile_{tag}_{r}.json"
                    cmd = [sys.executable, __file__, "--recipe", r, "--variant", variant, "--micro", str(micro), "--json", str(f),
                           "--layers", str(a.layers), "--prompt-len", str(a.prompt_len), "--new-tokens", str(a.new_tokens),
                           "--update-seqs", str(a.update_seqs), "--fwd-micro", str(a.fwd_micro), "--gemm-backend", a.gemm_backend,
                           "--warmup", str(a.warmup), "--steps", str(a.steps), "--profile-steps", str(a.profile_steps),
                           *(["--grad-ckpt"] if a.grad_ckpt else []), *(["--tiny"] if a.tiny else []),
                           *(["--import-vllm", a.import_vllm] if a.import_vllm else []),
                           *(["--requantize-weights"] if a.requantize_weights else []), *(["--liger"] if a.liger else [])]
                    t0 = time.time()
                    with open(f.with_suffix(".log"), "w") as log:
                        try:
                            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=a.timeout, env=env).returncode
                        except subprocess.TimeoutExpired:
                            rc = "timeout"
                    print(f"[update_profile] {variant} micro {micro} {r}: "
                          f"{'done' if rc == 0 else f'FAILED ({rc}); see ' + str(f.with_suffix('.log'))} in {time.time() - t0:.0f} s",
                          flush=True)
    results = [json.loads(p.read_text()) for p in sorted(out.glob("profile_*.json"))]
    order = {r: i for i, r in enumerate(["bf16", "jet_fp8", "fp8_rollout"])}
    results.sort(key=lambda r: (_key(r), order.get(r["recipe"], 9)))
    print(summarize(results))
    if a.record:
        print(record(results, a.device_name, a.command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
