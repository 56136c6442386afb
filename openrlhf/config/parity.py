"""How each flag of OpenRLHF v0.11's `train_ppo_ray` is treated here: the data behind docs/cli.md's parity table.

Every v0.11 flag parses (all are fields of `PPOConfig`, under the same dotted name). This table says what
each then does: `supported` (as in OpenRLHF), `differs` (it works, and the note says how it differs), or
`refused` (the run stops before it starts, with one line saying why; the note says why and what to do).
Tests check that the table holds exactly v0.11's flags and that every `refused` entry is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Parity", "OPENRLHF_V0_11"]

Status = Literal["supported", "differs", "refused"]


@dataclass(frozen=True)
class Parity:
    status: Status
    note: str = ""


def _same(note: str = "") -> Parity:
    return Parity("supported", note)


def _differs(how: str) -> Parity:
    return Parity("differs", how)


def _refused(why: str) -> Parity:
    return Parity("refused", why)


_RAY = "Ray mode; under an SPMD launcher (deepspeed, torchrun) the launcher's world decides"
_MUON = "only read with --{m}.optim muon, which is refused (see --{m}.optim)"
_LORA = "only read with --ds.lora.rank > 0, which is refused (see --ds.lora.rank)"
_VL = ("vision-language training is refused: the FP8 precision flow and both rollout engines are text-only; "
       "train a text model")
_ASYNC = ("asynchronous training is refused: it samples with weights at least one step behind the learner, which is "
          "off-policy whatever the precision; run synchronously")
_LOCAL = "a local folder, or a model id already in the Hugging Face cache (these machines reach no hub)"

# In the order of v0.11's parser.
OPENRLHF_V0_11: dict[str, Parity] = {
    "--ref.num_nodes": _same(_RAY),
    "--ref.num_gpus_per_node": _same(_RAY),
    "--reward.num_nodes": _same(_RAY),
    "--reward.num_gpus_per_node": _same(_RAY),
    "--train.colocate_actor_ref": _same("Ray mode placement; SPMD ranks hold every model anyway"),
    "--actor.num_nodes": _same(_RAY),
    "--actor.num_gpus_per_node": _same(_RAY),
    "--critic.num_nodes": _same(_RAY),
    "--critic.num_gpus_per_node": _same(_RAY),
    "--train.colocate_critic_reward": _same("Ray mode placement"),
    "--train.colocate_all": _same("Ray mode placement (hybrid engine); SPMD ranks are colocated by construction"),
    "--vllm.num_engines": _same("Ray mode (it also selects Ray mode when no launcher started the process); SPMD runs one engine per rank"),
    "--vllm.tensor_parallel_size": _differs(
        "each worker installs its slice of the trainer's FP8 bytes, and the digest check combines the slices' sums "
        "into the whole tensors' digests; refused where a shard would cut a 128x128 FP8 block (the line names the "
        "projection), with --precision.bitwise, for checkpoints that store projections fused (Phi-3), for mixture-of-experts "
        "models, and in SPMD mode on GPUs (use Ray mode, --vllm.num_engines)"
    ),
    "--vllm.sync_backend": _differs("default auto: gloo on CPU, CUDA IPC when engines share the policy ranks' GPUs (--train.colocate_all), else NCCL (v0.11: nccl)"),
    "--vllm.sync_with_ray": _differs(
        "weights always sync over a torch.distributed group (gloo/NCCL), not ray.util.collective: same bytes; "
        "the flag is accepted with a warning and changes nothing"
    ),
    "--vllm.enable_prefix_caching": _same("the cache is emptied after every weight sync (its blocks hold the old weights' keys/values)"),
    "--vllm.enforce_eager": _same("vLLM-CPU always runs eagerly"),
    "--vllm.enable_sleep": _same("with --train.colocate_all on GPUs; vLLM-CPU has no sleep mode (a no-op there)"),
    "--vllm.gpu_memory_utilization": _same("on CPU it is a fraction of host RAM, capped at 0.3 (the trainer shares it)"),
    "--algo.advantage.is_correction_enable": _same("needed by the off-policy recipe fp8_rollout; the unified flow needs none"),
    "--algo.advantage.is_correction_threshold": _same(),
    "--algo.advantage.is_correction_type": _same(),
    "--train.async_enable": _refused(_ASYNC),
    "--train.async_queue_size": _refused("only read with --train.async_enable, which is refused"),
    "--train.partial_rollout_enable": _refused(_ASYNC),
    "--eval.steps": _same(),
    "--ckpt.save_steps": _same(),
    "--logger.logging_steps": _same(),
    "--ckpt.path": _differs(
        "default <ckpt.output_dir>/checkpoints_ppo, holding actor/, critic/ and hf/ (v0.11: ./ckpt/checkpoints_ppo_ray "
        "with _actor, _critic, <tag>_hf); every checkpoint is checksummed and verified on resume"
    ),
    "--ckpt.save_hf": _differs("HF exports go to <ckpt.path>/hf/<tag> (the EMA with --train.enable_ema), pruned like checkpoints"),
    "--ckpt.disable_ds": _differs(
        "no DeepSpeed checkpoint is written, and each checkpoint step writes an HF export instead (v0.11 writes none "
        "without --ckpt.save_hf); with --ckpt.load_enable it is an error (nothing to resume from)"
    ),
    "--ckpt.max_num": _same("older checkpoints are removed only after the new one is complete"),
    "--ckpt.max_mem": _same("GiB of all checkpoints of a model; oldest removed first, the newest always kept"),
    "--ckpt.load_enable": _same("checksums are verified first; a different recipe or prompt set is refused"),
    "--ckpt.best_metric_key": _differs(
        "a better value keeps an HF export in <ckpt.path>/best (v0.11 keeps a DeepSpeed checkpoint tagged "
        "best_global_stepN and evicts worst-metric checkpoints first; here pruning is oldest-first)"
    ),
    "--ds.use_universal_ckpt": _same(
        "resumes from latest_universal; our checkpoints convert with `python -m deepspeed.checkpoint.ds_to_universal` "
        "without --inject_missing_state"
    ),
    "--local_rank": _same("set by the deepspeed launcher (--local-rank too)"),
    "--ds.zero_stage": _same(),
    "--actor.gradient_checkpointing_enable": _same("actor and critic"),
    "--ds.deepcompile": _refused(
        "DeepCompile traces ZeRO-3 into torch.compile graphs on CUDA; the FP8 linears' custom autograd functions are "
        "not among its tested passes"
    ),
    "--ds.param_dtype": _same("fp32 added, for CPU debugging"),
    "--train.enable_ema": _same(
        "an fp32 average in host memory (ZeRO-3: each rank its partition), exported as the final model and in HF "
        "exports, kept in checkpoints for resume"
    ),
    "--train.ema_beta": _same(),
    "--ds.zpg": _same("ZeRO++ hierarchical partitioning; needs --ds.zero_stage 3 and must divide the world size"),
    "--ds.adam_offload": _same(),
    "--ds.attn_implementation": _same(
        "flash_attention_* are refused without a CUDA GPU and flash-attn (use sdpa); jetrl_invariant added "
        "(float64, batch-invariant, for bit-exact verification on CPU)"
    ),
    "--ds.experts_implementation": _same("deepgemm is refused without a CUDA GPU and deep_gemm"),
    "--ds.use_liger_kernel": _differs(
        "Liger's RMSNorm and rotary kernels in the policy and reference forwards, its SwiGLU only where the MLP stays "
        "BF16 (an FP8 MLP keeps the flow's fused SwiGLU + quantizer); no fused-linear cross-entropy (the trainer needs "
        "per-token log-probs); needs a CUDA GPU and liger-kernel; refused with --precision.bitwise"
    ),
    "--ds.grad_accum_dtype": _same(),
    "--ds.overlap_comm": _same(),
    "--actor.gradient_checkpointing_reentrant": _same(),
    "--data.disable_fast_tokenizer": _same(),
    "--data.dataloader_num_workers": _differs(
        "prompts are read into memory once and tokenized per rollout: no loader workers run; accepted with a warning"
    ),
    "--ds.enable_sleep": _same("actor and critic parameters, fp32 masters and optimizer states parked in host memory during rollouts"),
    "--ds.tensor_parallel_size": _refused(
        "when > 1: AutoTP shards convert to FP8 with the unsharded bytes (openrlhf/models/tensor_parallel.py, tested on "
        "2 gloo ranks), but the trainer treats every rank as data parallel (own prompts, loss scaled by the world size, "
        "whole weights read for sync and export); shard with --ds.zero_stage 3 instead"
    ),
    "--ds.packing_samples": _same("FP8 quantization of packed tokens is byte-identical to unpacked"),
    "--train.dynamic_batch_enable": _same(),
    "--rollout.max_tokens_per_gpu": _same(),
    "--train.max_tokens_per_gpu": _same(),
    "--ds.load_in_4bit": _refused(
        "a 4-bit base under adapters: the engine would sample from merged weights re-quantized to FP8, which the "
        "training forward never computes; train the full model"
    ),
    "--ds.lora.rank": _refused(
        "when > 0: the engine would sample from merged weights re-quantized to FP8, which the training forward "
        "(base FP8 + adapter) never computes; train the full model"
    ),
    "--ds.lora.alpha": _refused(_LORA),
    "--ds.lora.target_modules": _refused(_LORA),
    "--ds.lora.dropout": _refused(_LORA),
    "--ckpt.output_dir": _same("the final model (HF format; the EMA with --train.enable_ema), plus summary.json and metrics.jsonl"),
    "--train.num_episodes": _same(),
    "--rollout.batch_size": _same(),
    "--rollout.vllm_generate_batch_size": _same(),
    "--rollout.micro_batch_size": _same(),
    "--train.max_epochs": _same(),
    "--data.max_len": _same("prompts that leave no room for a response are skipped and counted"),
    "--rollout.max_new_tokens": _same(),
    "--data.max_samples": _same(),
    "--actor.eps_clip": _same(),
    "--actor.eps_clip_low_high": _same(),
    "--actor.dual_clip": _same(),
    "--critic.value_clip": _same(),
    "--algo.advantage.lambd": _same(),
    "--algo.advantage.gamma": _same(),
    "--train.micro_batch_size": _same(),
    "--train.batch_size": _same(),
    "--reward.normalize_enable": _differs(
        "running mean/std over all rewards seen, for any reward source (v0.11 divides by the mean/std stored in the "
        "reward model's config)"
    ),
    "--rollout.top_p": _same(),
    "--rollout.temperature": _same("logprobs are of the temperature-scaled distribution on both sides"),
    "--train.seed": _same(),
    "--train.full_determinism_enable": _same(),
    "--critic.freezing_steps": _same(),
    "--rollout.n_samples_per_prompt": _same(),
    "--critic.save_value_network": _same("into <ckpt.output_dir>_critic, as a one-label sequence-classification model"),
    "--algo.kl.target": _same(),
    "--algo.kl.horizon": _same(),
    "--algo.kl.init_coef": _same(),
    "--actor.policy_loss_type": _same(),
    "--algo.kl.estimator": _same(),
    "--actor.aux_loss_coef": _refused(
        "when > 0: the policy loss is computed from log-probs only (no router logits), and MoE expert weights are not "
        "FP8 linears of the shared flow; drop it"
    ),
    "--actor.entropy_coef": _same("unset: no entropy computed; 0: logged only; > 0: an entropy bonus"),
    "--reward.clip_range": _same(),
    "--actor.optim": _refused(
        "muon: DeepSpeed's Muon orthogonalizes the update of 2D weights, whose FP8 copies are re-quantized from the "
        "BF16 masters each step; use adam"
    ),
    "--actor.muon.lr": _refused(_MUON.format(m="actor")),
    "--actor.muon.momentum": _refused(_MUON.format(m="actor")),
    "--actor.muon.ns_steps": _refused(_MUON.format(m="actor")),
    "--actor.muon.nesterov": _refused(_MUON.format(m="actor")),
    "--actor.muon.no_nesterov": _refused(_MUON.format(m="actor")),
    "--actor.adam.lr": _same(),
    "--actor.adam.betas": _same(),
    "--actor.adam.eps": _same(),
    "--actor.adam.weight_decay": _same(),
    "--actor.lr_scheduler": _same("transformers' schedules: cosine_with_min_lr, cosine, linear, constant, constant_with_warmup, polynomial"),
    "--actor.lr_warmup_ratio": _same(),
    "--actor.min_lr_ratio": _same(),
    "--actor.max_norm": _same(),
    "--critic.optim": _refused("muon, as --actor.optim; use adam"),
    "--critic.muon.lr": _refused(_MUON.format(m="critic")),
    "--critic.muon.momentum": _refused(_MUON.format(m="critic")),
    "--critic.muon.ns_steps": _refused(_MUON.format(m="critic")),
    "--critic.muon.nesterov": _refused(_MUON.format(m="critic")),
    "--critic.muon.no_nesterov": _refused(_MUON.format(m="critic")),
    "--critic.adam.lr": _same(),
    "--critic.adam.betas": _same(),
    "--critic.adam.eps": _same(),
    "--critic.adam.weight_decay": _same(),
    "--critic.lr_scheduler": _same(),
    "--critic.lr_warmup_ratio": _same(),
    "--critic.min_lr_ratio": _same(),
    "--critic.max_norm": _same(),
    "--algo.advantage.estimator": _same(),
    "--algo.kl.use_loss": _same(),
    "--algo.advantage.no_std_norm": _same("gae/reinforce/reinforce_baseline; with a group estimator it warns (use dr_grpo)"),
    "--reward.overlong_buffer_len": _same(),
    "--reward.overlong_penalty_factor": _same(),
    "--reward.stop_properly_penalty_coef": _same(),
    "--ds.ring_attn_size": _refused(
        "when > 1: ring attention runs on ring-flash-attn's CUDA kernels, and this trainer does not shard packed "
        "sequences across a ring"
    ),
    "--ds.ring_attn_head_stride": _refused("only read with --ds.ring_attn_size > 1, which is refused"),
    "--actor.model_name_or_path": _differs(_LOCAL),
    "--reward.model_name_or_path": _differs(
        _LOCAL + "; it must hold a one-output head named --ds.value_head_prefix (a random head is refused)"
    ),
    "--reward.remote_url": _same("an http(s) reward server, or a .py file defining reward_func"),
    "--critic.model_name_or_path": _differs(
        "default: the actor's model with a fresh value head (v0.11: the reward model); " + _LOCAL
    ),
    "--ds.value_head_prefix": _same("the head's name in critic and reward checkpoints, and in the exported critic"),
    "--ref.offload": _same(),
    "--reward.offload": _same(),
    "--train.agent_func_path": _same(),
    "--data.prompt_dataset": _differs(
        "local .jsonl/.json/.parquet files and datasets folders (no hub); comma-separated sources are blended"
    ),
    "--data.prompt_probs": _same("datasets.interleave_datasets, seeded by --train.seed, all_exhausted; weights are normalized"),
    "--data.prompt_split": _same(),
    "--eval.dataset": _differs("local files and folders, as --data.prompt_dataset"),
    "--eval.split": _same(),
    "--eval.temperature": _same(),
    "--eval.n_samples_per_prompt": _same(),
    "--data.input_key": _same(),
    "--data.label_key": _same(),
    "--data.input_template": _same(),
    "--data.apply_chat_template": _same(),
    "--logger.wandb.key": _same(),
    "--logger.wandb.org": _same(),
    "--logger.wandb.group": _same(),
    "--logger.wandb.project": _same(),
    "--logger.wandb.run_name": _same(),
    "--algo.dynamic_filtering_enable": _same(),
    "--algo.dynamic_filtering_range": _same(),
    "--data.image_key": _refused("only read for vision-language training (--data.max_images_per_prompt > 0), which is refused"),
    "--data.max_images_per_prompt": _refused("when > 0: " + _VL),
    "--actor.freeze_visual_encoder": _refused(_VL),
    "--logger.tensorboard_dir": _same(),
    "--use_ms": _refused("ModelScope hub: models load from local folders or the Hugging Face cache"),
}
