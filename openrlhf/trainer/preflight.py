"""Can this configuration run here? Checked after parsing, before anything is loaded.

Parsing accepts every OpenRLHF v0.11 flag, so an OpenRLHF script always gets past the parser;
this step then refuses, with one line each, what this framework or this machine cannot run:
features that need CUDA kernels (ring attention, flash attention, Liger), features built on
modules the FP8 precision flow does not cover (vision towers, LoRA adapters, 4-bit bases),
tensor-parallel training (with the shard sizes that would cut FP8 blocks in half named first), and
tensor-parallel engines whose shards would cut FP8 blocks.
docs/cli.md's parity table lists the same decisions.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from pathlib import Path

import torch

from openrlhf.trainer.ray import use_ray_mode

__all__ = ["preflight_errors", "fp8_tp_shard_errors", "path_errors", "engine_errors"]

BLOCK = 128


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _model_config(path: str | None) -> dict | None:
    if path and (Path(path) / "config.json").is_file():
        cfg = json.loads((Path(path) / "config.json").read_text())
        return cfg.get("text_config", cfg)
    return None


def fp8_tp_shard_errors(model_config: dict, tp: int, flag: str = "--ds.tensor_parallel_size", replicate_kv: bool = False) -> list[str]:
    """Tensor parallelism splits q/k/v/gate/up by output rows (column parallel) and o/down by input columns
    (row parallel). FP8 weights are quantized in 128x128 blocks and activations in 1x128 groups
    along K, so every shard boundary must fall on a multiple of 128: a split inside a block would
    give each rank a different scale for half a block than the unsharded layer uses.
    `replicate_kv`: with more ranks than KV heads, each rank holds one whole KV head (vLLM replicates them)."""
    h = model_config.get("hidden_size")
    inter = model_config.get("intermediate_size")
    heads = model_config.get("num_attention_heads")
    kv = model_config.get("num_key_value_heads", heads)
    if not (h and inter and heads):
        return []
    head_dim = model_config.get("head_dim") or h // heads
    kv_rows = kv * head_dim
    if replicate_kv and tp > kv and tp % kv == 0:
        kv_rows = head_dim * tp  # one head per rank
    dims = {
        "q_proj rows (column parallel)": heads * head_dim,
        "k_proj/v_proj rows (column parallel)": kv_rows,
        "gate_proj/up_proj rows (column parallel)": inter,
        "o_proj columns (row parallel)": heads * head_dim,
        "down_proj columns (row parallel)": inter,
    }
    errors = []
    for what, n in dims.items():
        if n % tp or (n // tp) % BLOCK:
            errors.append(
                f"{flag} {tp} splits {what} of {n} into shards of {n / tp:g}, not a multiple of "
                f"{BLOCK}: the FP8 128x128 weight blocks and 1x128 activation groups would straddle ranks"
            )
    return errors


def _engine_tp_errors(cfg, cuda: bool, ray: bool) -> list[str]:
    """A vLLM engine split over --vllm.tensor_parallel_size workers: each holds a slice of every projection,
    installs its slice of the trainer's FP8 bytes and sums its window for the digest check."""
    tp, flag = cfg.vllm.tensor_parallel_size, "--vllm.tensor_parallel_size"
    errors = []
    if cuda and not ray:
        errors.append(
            f"{flag} {tp}: in SPMD mode each trainer rank hosts one engine on its own GPU; an engine over {tp} GPUs "
            f"runs in Ray mode: add --vllm.num_engines (each engine takes {tp} GPUs), or use {flag} 1"
        )
    if cfg.precision.bitwise:
        errors.append(
            f"{flag} {tp} with --precision.bitwise: a tensor-parallel engine adds its row-parallel layers' partial "
            f"sums across workers, in another order than the trainer's one GEMM, so it cannot be bit-exact; use {flag} 1"
        )
    model = _model_config(cfg.actor.model_name_or_path)
    if model is None:
        return errors
    heads, kv = model.get("num_attention_heads"), model.get("num_key_value_heads", model.get("num_attention_heads"))
    if heads and kv and (heads % tp or (kv % tp and tp % kv)):
        errors.append(
            f"{flag} {tp} must divide the model's {heads} attention heads, and divide or be a multiple of its {kv} KV "
            "heads (vLLM splits heads between workers)"
        )
    elif any(model.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        errors.append(
            f"{flag} {tp}: vLLM splits a mixture-of-experts layer's experts between tensor-parallel workers in its own "
            f"fused layout, which the digest check after every sync cannot read back yet; use {flag} 1"
        )
    elif not cfg.precision.load_recipe().rollout.is_fp8:
        pass  # a BF16 engine: no FP8 blocks to keep whole
    elif model.get("model_type") == "phi3":
        errors.append(
            f"{flag} {tp}: this model's checkpoint stores q/k/v and gate/up fused (Phi-3), which the FP8 engine "
            f"cannot yet split between tensor-parallel workers; use {flag} 1"
        )
    else:
        errors += fp8_tp_shard_errors(model, tp, flag, replicate_kv=True)
    return errors


def preflight_errors(cfg, *, cuda: bool | None = None, ray: bool | None = None) -> list[str]:
    """Every reason `cfg` cannot run on this machine with this framework, one line each. `cuda`, `ray`: whether
    this runs on GPUs and in Ray mode (default: what this machine and process say)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    ds, data, actor = cfg.ds, cfg.data, cfg.actor
    errors: list[str] = []
    if ds.ring_attn_size > 1:
        missing = [w for w, ok in (("a CUDA GPU", cuda), ("the ring-flash-attn package", _has("ring_flash_attn")),
                                   ("flash-attn", _has("flash_attn"))) if not ok]
        model = _model_config(actor.model_name_or_path)
        if model and model.get("num_attention_heads", 1) % ds.ring_attn_head_stride:
            errors.append(
                f"--ds.ring_attn_head_stride {ds.ring_attn_head_stride} must divide the model's "
                f"{model['num_attention_heads']} attention heads"
            )
        errors.append(
            f"--ds.ring_attn_size {ds.ring_attn_size}: ring attention runs on ring-flash-attn's CUDA kernels; "
            + (f"missing here: {', '.join(missing)}" if missing else "this trainer does not shard packed sequences across a ring")
            + "; drop --ds.ring_attn_size (and --ds.ring_attn_head_stride)"
        )
    if ds.tensor_parallel_size > 1:
        recipe = cfg.precision.load_recipe()
        model = _model_config(actor.model_name_or_path)
        shard_errors = fp8_tp_shard_errors(model, ds.tensor_parallel_size) if model and recipe.name != "bf16" else []
        errors += shard_errors
        if not shard_errors:
            errors.append(
                f"--ds.tensor_parallel_size {ds.tensor_parallel_size}: the trainer does not run tensor-parallel groups yet. "
                "DeepSpeed AutoTP shards the model and its layers convert to FP8 with the unsharded bytes "
                "(openrlhf.models.tensor_parallel), but the trainer treats every rank as data parallel: it gives each rank "
                "its own prompts (a group needs one rollout and identical micro-batches), scales the loss by the world "
                "size, and reads whole weights from each rank for the weight sync and the HF export. Shard with "
                "--ds.zero_stage 3 instead"
            )
    uses_vllm = cfg.rollout.engine == "vllm" or (cfg.rollout.engine == "auto" and (cuda or not cfg.precision.bitwise) and _has("vllm"))
    if uses_vllm and cfg.vllm.tensor_parallel_size > 1:
        errors += _engine_tp_errors(cfg, cuda, use_ray_mode(cfg) if ray is None else ray)
    if cfg.precision.bitwise and uses_vllm and not cuda:
        errors.append(
            "--precision.bitwise --rollout.engine vllm: vLLM's bitwise mode runs on CUDA (the trainer's Triton kernels in "
            "vLLM's compiled graphs); on CPU use --rollout.engine hf, whose batch-invariant numerics are the CPU's"
        )
    if "flash_attention" in ds.attn_implementation and not (cuda and _has("flash_attn")):
        errors.append(
            f"--ds.attn_implementation {ds.attn_implementation} needs a CUDA GPU and the flash-attn package "
            f"({'no CUDA device' if not cuda else 'flash-attn not installed'}); use sdpa (packing works with it too)"
        )
    softcap = (_model_config(actor.model_name_or_path) or {}).get("attn_logit_softcapping")
    if softcap and "sdpa" in cfg.policy_attn_implementation:
        # transformers' sdpa attention drops the cap without a word: the policy would be another model than the
        # pretrained one and than the engine, which applies it.
        errors.append(
            f"{actor.model_name_or_path} soft-caps its attention logits (attn_logit_softcapping={softcap}, Gemma 2), "
            f"which --ds.attn_implementation {ds.attn_implementation} skips; use eager or flash_attention_2"
        )
    if data.max_images_per_prompt > 0 or actor.freeze_visual_encoder:
        errors.append(
            "vision-language training (--data.max_images_per_prompt, --actor.freeze_visual_encoder) is not supported: "
            "the FP8 precision flow and both rollout engines here are text-only"
        )
    if ds.lora.rank > 0 or ds.load_in_4bit:
        errors.append(
            "LoRA / 4-bit training (--ds.lora.rank, --ds.load_in_4bit) is not supported: the engine would sample from "
            "merged weights re-quantized to FP8, which the training forward (base FP8 + adapter) never computes, so "
            "rollout and training would not share one precision flow"
        )
    if ds.use_liger_kernel:
        from openrlhf.models.liger import liger_missing

        if cfg.precision.bitwise:
            errors.append(
                "--ds.use_liger_kernel with --precision.bitwise: the bitwise mode's policy runs the engine's batch-invariant "
                "norm and rotary kernels, which Liger's would replace; drop one of the two"
            )
        elif missing := liger_missing(cuda):
            errors.append(f"--ds.use_liger_kernel needs a CUDA GPU with Liger: {missing}; or drop the flag")
    if ds.deepcompile:
        errors.append(
            "--ds.deepcompile is not supported: DeepCompile traces ZeRO-3 into torch.compile graphs on CUDA, "
            "and the FP8 linears' custom autograd functions are not part of its tested passes"
        )
    if cfg.train.async_enable or cfg.train.partial_rollout_enable:
        errors.append(
            "--train.async_enable / --train.partial_rollout_enable are not supported: asynchronous training samples with "
            "weights at least one step behind the learner, which is off-policy whatever the precision; run synchronously"
        )
    if actor.aux_loss_coef > 0:
        errors.append(
            f"--actor.aux_loss_coef {actor.aux_loss_coef}: the MoE load-balancing loss is not supported: the policy "
            "loss here is computed from log-probs only (the router logits it needs are not returned), and MoE expert "
            "weights are not FP8 linears of the shared precision flow; drop the flag (dense models need none)"
        )
    if ds.experts_implementation == "deepgemm" and not (cuda and _has("deep_gemm")):
        errors.append(
            "--ds.experts_implementation deepgemm runs transformers' MoE experts on DeepGEMM kernels, which need a CUDA "
            f"GPU and the deep_gemm package ({'no CUDA device' if not cuda else 'deep_gemm not installed'}); "
            "use grouped_mm, batched_mm or eager"
        )
    if cfg.use_ms:
        errors.append("--use_ms (ModelScope hub) is not supported: models load from local folders or the Hugging Face cache")
    if actor.optim == "muon" or cfg.critic.optim == "muon":
        errors.append(
            "--actor.optim/--critic.optim muon is not supported: DeepSpeed's Muon orthogonalizes the update of 2D weights, "
            "whose FP8 copies are re-quantized from the BF16 masters each step; use adam"
        )
    if cfg.reward_source == "math" and not _has("math_verify"):
        # The rule-based reward scores 0.0 on any failure, so a missing checker would look like a model that never learns.
        errors.append(
            "the rule-based math reward (no --reward.model_name_or_path or --reward.remote_url) needs math-verify, which "
            "is not installed: pip install 'math-verify==0.9.0'"
        )
    return errors


# ---- paths: checked before the first step, so no run dies (or loses its work) at the end ---------------
def _model_path_error(flag: str, path: str | None) -> str | None:
    """A model folder must exist with a config.json (or be a model id already in the Hugging Face cache)."""
    if not path:
        return None
    p = Path(path).expanduser()
    if p.is_file():
        return f"{flag} {path} is a file; pass the model folder (the one holding config.json and the weights)"
    if p.is_dir():
        if not (p / "config.json").is_file():
            return f"{flag} {path} has no config.json: not a transformers model folder (save it with save_pretrained)"
        return None
    if not p.is_absolute() and not path.startswith(".") and path.count("/") <= 1:
        from huggingface_hub import try_to_load_from_cache

        try:
            if isinstance(try_to_load_from_cache(path, "config.json"), str):
                return None  # a hub model id available offline
        except ValueError:  # not a valid repo id either
            pass
    return (
        f"{flag} {path} does not exist: pass a local model folder with config.json "
        "(or the id of a model already in the Hugging Face cache; the hub itself is not reached)"
    )


def _writable_dir_error(flag: str, path: str | os.PathLike) -> str | None:
    """Create `path` if needed and write (then remove) a probe file in it."""
    p = Path(path).expanduser()
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=p, prefix=".write_probe_"):
            pass
    except OSError as e:
        return f"{flag} {path} is not a writable folder ({e.strerror or type(e).__name__}): choose another path, or fix its permissions"
    return None


def path_errors(cfg, *, write_probes: bool = True) -> list[str]:
    """What would make the run fail on a path: missing models, and output, checkpoint or TensorBoard folders
    that cannot be written (found now, not when the first checkpoint or the final model is saved).

    `write_probes=False` skips the folder checks (ranks other than 0 never write them).
    """
    errors = [
        e for e in (
            _model_path_error("--actor.model_name_or_path", cfg.actor.model_name_or_path),
            _model_path_error("--ref.model_name_or_path", cfg.ref.model_name_or_path if cfg.needs_ref else None),
            _model_path_error("--critic.model_name_or_path", cfg.critic.model_name_or_path if cfg.needs_critic else None),
            _model_path_error("--reward.model_name_or_path", cfg.reward.model_name_or_path),
        ) if e
    ]
    if write_probes:
        folders = [("--ckpt.output_dir", cfg.ckpt.output_dir)]
        if cfg.ckpt.save_steps != 0 or cfg.ckpt.load_enable:
            folders.append(("--ckpt.path", cfg.ckpt_path))
        if cfg.logger.tensorboard_dir:
            folders.append(("--logger.tensorboard_dir", cfg.logger.tensorboard_dir))
        errors += [e for flag, path in folders if (e := _writable_dir_error(flag, path))]
    return errors


def engine_errors(cfg, *, ray: bool) -> list[str]:
    """A colocated vLLM engine on a machine without CUDA is vLLM-CPU, which runs fp32 only (bf16
    crashes its attention kernel): with a bf16/fp16 trainer the engine cannot run the trainer's
    precision, and the precision check would refuse the run after loading everything. (Ray mode
    is not checked here: its engines may sit on GPU nodes.)"""
    if ray or torch.cuda.is_available() or cfg.ds.param_dtype == "fp32":
        return []
    from .engines.factory import engine_kind

    if engine_kind(cfg.rollout.engine) != "vllm":
        return []
    picked = " (--rollout.engine auto picked vLLM)" if cfg.rollout.engine == "auto" else ""
    return [
        f"--ds.param_dtype {cfg.ds.param_dtype} with the vLLM engine on CPU{picked}: vLLM-CPU runs in fp32 only, so its "
        "rollout could not match the trainer's precision; pass --ds.param_dtype fp32, or --rollout.engine hf"
    ]
