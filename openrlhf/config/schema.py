"""The run's configuration: one frozen dataclass per flag section, composed into `PPOConfig`.

Sections: `actor`, `ref`, `critic`, `reward`, `data`, `rollout`, `train`, `algo`, `ds`,
`vllm`, `ckpt`, `logger`, `precision`. Every field is one dotted flag, `--<section>.<field>`
(nested sections add dots: `--actor.adam.lr`); its metadata (`opt`, `section`) is the one place
a flag is declared: the parser (`flags`, `parser`), the checks (`validation`) and docs/cli.md
(`docs`) are generated from it. Components take their own section (`VLLMEngine.from_config`
gets `cfg.vllm`), not the whole `PPOConfig`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from .fields import from_nested, opt, section, to_plain

__all__ = [
    "AdamConfig",
    "MuonConfig",
    "LoraConfig",
    "EvalConfig",
    "ActorConfig",
    "RefConfig",
    "CriticConfig",
    "RewardConfig",
    "DataConfig",
    "RolloutConfig",
    "TrainConfig",
    "AdvantageConfig",
    "KLConfig",
    "AlgoConfig",
    "DeepSpeedConfig",
    "VLLMConfig",
    "CkptConfig",
    "WandbConfig",
    "LoggerConfig",
    "PrecisionConfig",
    "PPOConfig",
    "GROUP_ESTIMATORS",
]

# transformers' schedules that take (warmup, total) steps, as OpenRLHF passes --<model>.lr_scheduler to get_scheduler.
LRSchedule = Literal["cosine_with_min_lr", "cosine", "linear", "constant", "constant_with_warmup", "polynomial"]

# Estimators whose baseline is computed from the other samples of the same prompt.
GROUP_ESTIMATORS = ("group_norm", "rloo", "reinforce_baseline", "dr_grpo")


@dataclass(frozen=True)
class AdamConfig:
    lr: float = opt(1e-6, "learning rate (peak, after warmup)", ge=0.0)
    betas: tuple[float, float] = opt((0.9, 0.95), "AdamW betas: BETA1 BETA2")
    eps: float = opt(1e-8, "AdamW epsilon", gt=0.0)
    weight_decay: float = opt(0.0, "decoupled weight decay", ge=0.0)


@dataclass(frozen=True)
class MuonConfig:
    lr: float = opt(0.02, "Muon learning rate of the 2D weights (with --<model>.optim muon)", ge=0.0)
    momentum: float = opt(0.95, "Muon momentum", ge=0.0, le=1.0)
    ns_steps: int = opt(5, "Muon Newton-Schulz iterations", ge=1)
    nesterov: bool = opt(True, "Nesterov momentum in Muon (on by default)")
    no_nesterov: bool = opt(False, "turn Nesterov momentum off in Muon")


@dataclass(frozen=True)
class LoraConfig:
    rank: int = opt(0, "LoRA rank (0: off); refused: see docs/cli.md", ge=0)
    alpha: int = opt(16, "LoRA alpha")
    target_modules: tuple[str, ...] = opt(("all-linear",), "modules that get LoRA adapters")
    dropout: float = opt(0.0, "LoRA dropout", ge=0.0, le=1.0)


@dataclass(frozen=True)
class EvalConfig:
    steps: int = opt(-1, "evaluate on --eval.dataset every N steps (-1: never)", aliases=["--eval_steps"])
    dataset: str | None = opt(
        None, "evaluation prompts (same formats and --data.* keys as the prompt dataset)", aliases=["--eval_dataset"]
    )
    split: str = opt("train", "split to read from the evaluation dataset", aliases=["--eval_split"])
    temperature: float = opt(0.6, "sampling temperature of the evaluation", aliases=["--eval_temperature"], ge=0.0)
    n_samples_per_prompt: int = opt(4, "samples per evaluation prompt (pass@n and pass@1 from them)", ge=1)


@dataclass(frozen=True)
class ActorConfig:
    model_name_or_path: str | None = opt(
        None, "policy model: a HF model id or a local folder (required)", aliases=["--pretrain"]
    )
    num_nodes: int = opt(1, "nodes for the actor group (Ray mode)", aliases=["--actor_num_nodes"], ge=1)
    num_gpus_per_node: int = opt(
        1, "GPUs per node for the actor group (Ray mode)", aliases=["--actor_num_gpus_per_node"], ge=1
    )
    gradient_checkpointing_enable: bool = opt(
        False, "recompute activations in backward to save memory", aliases=["--gradient_checkpointing"]
    )
    eps_clip: float = opt(0.2, "PPO ratio clip: ratio is clipped to [1-eps, 1+eps]", aliases=["--eps_clip"], gt=0.0)
    eps_clip_low_high: tuple[float, float] | None = opt(
        None,
        "clip-higher (DAPO): LOW HIGH clip the ratio to [1-LOW, 1+HIGH]; overrides --actor.eps_clip",
        aliases=["--eps_clip_low_high"],
    )
    dual_clip: float | None = opt(
        None,
        "dual-clip PPO: caps the loss of negative-advantage tokens at dual_clip*|A| (> 1)",
        aliases=["--dual_clip"],
    )
    entropy_coef: float | None = opt(
        None, "entropy bonus coefficient (unset: no entropy computed; 0: entropy only logged)", aliases=["--entropy_loss_coef"], ge=0.0
    )
    max_norm: float = opt(1.0, "gradient clipping norm", aliases=["--max_norm"], gt=0.0)
    lr_warmup_ratio: float = opt(
        0.03, "fraction of optimizer steps spent in linear warmup", aliases=["--lr_warmup_ratio"], ge=0.0, le=1.0
    )
    min_lr_ratio: float = opt(0.1, "final lr as a fraction of the peak lr (cosine_with_min_lr)", ge=0.0, le=1.0)
    lr_scheduler: LRSchedule = opt(
        "cosine_with_min_lr", "learning-rate schedule (transformers' get_scheduler; constant has no warmup)",
        aliases=["--lr_scheduler"],
    )
    adam: AdamConfig = section(AdamConfig, "actor optimizer (AdamW)", aliases={"lr": ["--actor_learning_rate"]})
    gradient_checkpointing_reentrant: bool = opt(
        False, "reentrant activation checkpointing (torch's use_reentrant=True)", aliases=["--gradient_checkpointing_use_reentrant"]
    )
    policy_loss_type: Literal["ppo", "gspo"] = opt(
        "ppo", "ppo: token-level ratio; gspo: one length-normalized ratio per sequence, sequence-mean loss"
    )
    aux_loss_coef: float = opt(0.0, "MoE load-balancing loss coefficient; refused when > 0: see docs/cli.md", ge=0.0)
    optim: Literal["adam", "muon"] = opt("adam", "optimizer; muon is refused: see docs/cli.md")
    muon: MuonConfig = section(MuonConfig, "Muon optimizer settings (accepted; muon is refused)")
    freeze_visual_encoder: bool = opt(False, "vision-language models only; refused: see docs/cli.md")


@dataclass(frozen=True)
class RefConfig:
    model_name_or_path: str | None = opt(None, "reference model (default: the actor's model)")
    num_nodes: int = opt(1, "nodes for the reference group (Ray mode)", aliases=["--ref_num_nodes"], ge=1)
    num_gpus_per_node: int = opt(
        1, "GPUs per node for the reference group (Ray mode)", aliases=["--ref_num_gpus_per_node"], ge=1
    )
    offload: bool = opt(
        False, "keep the reference model's weights on CPU between uses", aliases=["--ref_reward_offload"]
    )


@dataclass(frozen=True)
class CriticConfig:
    model_name_or_path: str | None = opt(
        None, "critic (value) model, used by gae only (default: the actor's model)", aliases=["--critic_pretrain"]
    )
    num_nodes: int = opt(1, "nodes for the critic group (Ray mode)", aliases=["--critic_num_nodes"], ge=1)
    num_gpus_per_node: int = opt(
        1, "GPUs per node for the critic group (Ray mode)", aliases=["--critic_num_gpus_per_node"], ge=1
    )
    value_clip: float = opt(0.5, "value-loss clip around the old values", aliases=["--value_clip"], ge=0.0)
    adam: AdamConfig = section(
        AdamConfig, "critic optimizer (AdamW)", aliases={"lr": ["--critic_learning_rate"]}, lr=9e-6
    )
    lr_scheduler: LRSchedule = opt("cosine_with_min_lr", "critic learning-rate schedule (as --actor.lr_scheduler)")
    lr_warmup_ratio: float = opt(0.03, "fraction of critic optimizer steps in linear warmup", ge=0.0, le=1.0)
    min_lr_ratio: float = opt(0.1, "critic's final lr as a fraction of its peak lr", ge=0.0, le=1.0)
    max_norm: float = opt(1.0, "critic gradient clipping norm", gt=0.0)
    freezing_steps: int = opt(-1, "train only the critic for the first N steps (the actor is frozen)", aliases=["--freezing_actor_steps"])
    save_value_network: bool = opt(
        False, "export the critic at the end into <ckpt.output_dir>_critic (a one-label sequence classifier)",
        aliases=["--save_value_network"],
    )
    optim: Literal["adam", "muon"] = opt("adam", "optimizer; muon is refused: see docs/cli.md")
    muon: MuonConfig = section(MuonConfig, "Muon optimizer settings (accepted; muon is refused)")


@dataclass(frozen=True)
class RewardConfig:
    model_name_or_path: str | None = opt(
        None,
        "reward model; with neither this nor --reward.remote_url, the rule-based math reward (math-verify) is used",
        aliases=["--reward_pretrain"],
    )
    remote_url: str | None = opt(
        None, "an http(s) URL of a reward server, or a .py file defining reward_func", aliases=["--remote_rm_url"]
    )
    num_nodes: int = opt(1, "nodes for the reward group (Ray mode)", aliases=["--reward_num_nodes"], ge=1)
    num_gpus_per_node: int = opt(
        1, "GPUs per node for the reward group (Ray mode)", aliases=["--reward_num_gpus_per_node"], ge=1
    )
    normalize_enable: bool = opt(False, "normalize rewards with running statistics", aliases=["--normalize_reward"])
    clip_range: tuple[float, float] = opt(
        (-10.0, 10.0), "clip rewards to LOW HIGH", aliases=["--reward_clip_range"]
    )
    overlong_buffer_len: float | None = opt(
        None, "DAPO overlong penalty: ramp over the last N tokens of the generation budget", aliases=["--overlong_buffer_len"], gt=0.0
    )
    overlong_penalty_factor: float = opt(1.0, "DAPO overlong penalty at the full budget", aliases=["--overlong_penalty_factor"], ge=0.0)
    stop_properly_penalty_coef: float | None = opt(
        None, "truncated responses: reward scaled by C (C >= 0) or set to C (C < 0)", aliases=["--stop_properly_penalty_coef"]
    )
    offload: bool = opt(False, "keep the reward model in host memory between uses")


@dataclass(frozen=True)
class DataConfig:
    prompt_dataset: str | None = opt(
        None,
        "prompt data: a .jsonl/.json/.parquet file or a local HF datasets folder, or several comma-separated (required)",
        aliases=["--prompt_data"],
    )
    prompt_split: str = opt("train", "split to read from the prompt dataset", aliases=["--prompt_split"])
    input_key: str = opt("input", "dataset column holding the prompt", aliases=["--input_key"])
    label_key: str | None = opt(
        None, "dataset column holding the reference answer (passed to the reward)", aliases=["--label_key"]
    )
    input_template: str | None = opt(
        None, "format string applied to the prompt, with one {} for it", aliases=["--input_template"]
    )
    apply_chat_template: bool = opt(
        False, "wrap the prompt with the tokenizer's chat template", aliases=["--apply_chat_template"]
    )
    max_len: int = opt(2048, "max tokens of prompt + response", aliases=["--max_len"])
    max_samples: int | None = opt(None, "use at most this many prompts", aliases=["--max_samples"], ge=1)
    prompt_probs: str | None = opt(
        None, "sampling weights of comma-separated --data.prompt_dataset sources, e.g. 0.7,0.3 (without: concatenated)",
        aliases=["--prompt_data_probs"],
    )
    disable_fast_tokenizer: bool = opt(False, "load the slow (Python) tokenizer", aliases=["--disable_fast_tokenizer"])
    dataloader_num_workers: int = opt(0, "no effect here (a warning): prompts are read into memory, no loader workers run", ge=0)
    image_key: str = opt("images", "vision-language datasets only (unused while max_images_per_prompt is 0)")
    max_images_per_prompt: int = opt(0, "vision-language training; refused when > 0: see docs/cli.md", ge=0)


@dataclass(frozen=True)
class RolloutConfig:
    batch_size: int = opt(1024, "prompts per rollout (one PPO step)", aliases=["--rollout_batch_size"], ge=1)
    micro_batch_size: int = opt(
        1, "samples per forward when computing logprobs/values", aliases=["--micro_rollout_batch_size"], ge=1
    )
    n_samples_per_prompt: int = opt(
        1, "responses sampled per prompt (>= 2 for group estimators)", aliases=["--n_samples_per_prompt"], ge=1
    )
    max_new_tokens: int | None = opt(
        None,
        "max generated tokens (default: data.max_len - prompt length)",
        aliases=["--max_new_tokens", "--generate_max_len"],
    )
    temperature: float = opt(1.0, "sampling temperature", aliases=["--temperature"], ge=0.0)
    top_p: float = opt(1.0, "nucleus sampling threshold", aliases=["--top_p"], gt=0.0, le=1.0)
    top_k: int = opt(-1, "top-k sampling (-1 = off)", ge=-1)
    ignore_eos: bool = opt(
        False, "sample every response to max_new_tokens, past EOS (rollout-length studies, as verl's rollout.ignore_eos)"
    )
    max_tokens_per_gpu: int | None = opt(
        None, "dynamic batching: tokens per logprob/value forward (default: --train.max_tokens_per_gpu)", ge=1
    )
    vllm_generate_batch_size: int | None = opt(
        None, "prompts per engine generate call (default and maximum: --rollout.batch_size)", ge=1
    )
    engine: Literal["auto", "vllm", "hf"] = opt(
        "auto", "rollout engine: vllm, hf (transformers), or auto (vllm if importable, else hf)"
    )


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = opt(128, "samples per optimizer step (global)", aliases=["--train_batch_size"], ge=1)
    micro_batch_size: int = opt(1, "samples per forward/backward per rank", aliases=["--micro_train_batch_size"], ge=1)
    max_epochs: int = opt(1, "passes over each rollout's samples", aliases=["--max_epochs"], ge=1)
    num_episodes: int = opt(1, "passes over the prompt dataset", aliases=["--num_episodes"], ge=1)
    seed: int = opt(42, "random seed (data order, sampling, init)", aliases=["--seed"])
    max_steps: int | None = opt(None, "stop after this many optimizer steps (handy for demos)", ge=1)
    eval_prompts: int = opt(
        0, "prompts (the dataset's first) of a sampled-reward evaluation before and after training; 0: none", ge=0
    )
    eval_samples: int = opt(4, "samples per evaluation prompt", aliases=["--eval_n_samples_per_prompt"], ge=1)
    colocate_actor_ref: bool = opt(False, "put actor and reference on the same GPUs", aliases=["--colocate_actor_ref"])
    colocate_all: bool = opt(
        False,
        "put all models and the rollout engines on the same GPUs (hybrid engine)",
        aliases=["--colocate_all_models"],
    )
    colocate_critic_reward: bool = opt(
        False, "put critic and reward model on the same GPUs", aliases=["--colocate_critic_reward"]
    )
    dynamic_batch_enable: bool = opt(
        False, "micro-batches bounded by tokens (--train.max_tokens_per_gpu), packed", aliases=["--use_dynamic_batch"]
    )
    max_tokens_per_gpu: int = opt(16192, "dynamic batching: tokens per training micro-batch", ge=1)
    agent_func_path: str | None = opt(
        None, "a .py file defining AgentExecutor: multi-turn rollouts through your agent", aliases=["--agent_func_path"]
    )
    full_determinism_enable: bool = opt(False, "deterministic torch algorithms (slower)", aliases=["--full_determinism"])
    enable_ema: bool = opt(
        False, "keep an fp32 exponential moving average of the actor; it is what the final model and HF exports hold"
    )
    ema_beta: float = opt(0.992, "EMA decay", gt=0.0, le=1.0)
    async_enable: bool = opt(False, "asynchronous training; refused: see docs/cli.md", aliases=["--async_train"])
    async_queue_size: int = opt(1, "async training queue size (accepted; async is refused)", ge=1)
    partial_rollout_enable: bool = opt(False, "async partial rollouts; refused: see docs/cli.md")


@dataclass(frozen=True)
class AdvantageConfig:
    estimator: Literal["gae", "group_norm", "rloo", "reinforce", "reinforce_baseline", "dr_grpo"] = opt(
        "gae", "advantage estimator; group_norm is GRPO", aliases=["--advantage_estimator"]
    )
    gamma: float = opt(1.0, "discount factor", aliases=["--gamma"], ge=0.0, le=1.0)
    lambd: float = opt(1.0, "GAE lambda", aliases=["--lambd"], ge=0.0, le=1.0)
    no_std_norm: bool = opt(
        False, "gae/reinforce/reinforce_baseline: normalize advantages over the batch by their mean only (no std)",
        aliases=["--no_advantage_std_norm"],
    )
    is_correction_enable: bool = opt(
        False,
        "importance-sampling correction for the rollout/train mismatch (needed by off-policy recipes)",
        aliases=["--enable_vllm_is_correction"],
    )
    is_correction_type: Literal["tis", "icepop", "seq-mask-tis"] = opt(
        "tis",
        "tis: truncate the IS weight; icepop: mask tokens whose weight leaves the range; seq-mask-tis: tis, and mask "
        "sequences whose geometric-mean weight leaves it",
        aliases=["--vllm_is_correction_type"],
    )
    is_correction_threshold: tuple[float, float] = opt(
        (0.5, 5.0), "IS weight range LOW HIGH", aliases=["--vllm_is_truncated_threshold"]
    )


@dataclass(frozen=True)
class KLConfig:
    init_coef: float = opt(
        0.01, "KL coefficient (0 with no KL loss = no reference model)", aliases=["--init_kl_coef"], ge=0.0
    )
    use_loss: bool = opt(False, "KL as a loss term instead of a reward penalty", aliases=["--use_kl_loss"])
    estimator: Literal["k1", "k2", "k3"] = opt(
        "k1", "KL estimator (k1 in the reward; k2/k3 as a loss)", aliases=["--kl_estimator"]
    )
    target: float | None = opt(
        None, "target KL for the adaptive controller (None = fixed coef)", aliases=["--kl_target"]
    )
    horizon: int = opt(10000, "adaptive KL controller horizon", aliases=["--kl_horizon"], ge=1)


@dataclass(frozen=True)
class AlgoConfig:
    advantage: AdvantageConfig = section(AdvantageConfig, "advantages and importance-sampling correction")
    kl: KLConfig = section(KLConfig, "KL regularization against the reference model")
    dynamic_filtering_enable: bool = opt(
        False, "DAPO dynamic sampling: drop prompts whose samples' mean score is outside the range, refill the batch",
        aliases=["--dynamic_filtering"],
    )
    dynamic_filtering_range: tuple[float, float] = opt(
        (0.0, 1.0), "keep a prompt when LOW < mean score < HIGH", aliases=["--dynamic_filtering_reward_range"]
    )


@dataclass(frozen=True)
class DeepSpeedConfig:
    zero_stage: Literal[0, 1, 2, 3] = opt(2, "DeepSpeed ZeRO stage", aliases=["--zero_stage"])
    param_dtype: Literal["bf16", "fp16", "fp32"] = opt(
        "bf16",
        "master-model dtype (fp32 for CPU debugging)",
        aliases=["--param_dtype"],
        const_aliases={"--bf16": "bf16"},
    )
    adam_offload: bool = opt(False, "keep optimizer states on CPU", aliases=["--adam_offload"])
    attn_implementation: str = opt("sdpa", "HF attention implementation (eager, sdpa, flash_attention_2, or jetrl_invariant: float64, batch-invariant, for bit-exact rollout/train verification on CPU)",
                                   aliases=["--attn_implementation"])
    overlap_comm: bool = opt(False, "overlap ZeRO communication with compute", aliases=["--overlap_comm"])
    packing_samples: bool = opt(False, "pack samples into one row without padding", aliases=["--packing_samples"])
    enable_sleep: bool = opt(
        False, "park actor/critic weights and optimizer states in host memory while the engine generates",
        aliases=["--deepspeed_enable_sleep"],
    )
    tensor_parallel_size: int = opt(
        1, "DeepSpeed AutoTP size; refused when > 1: see docs/cli.md", aliases=["--ds_tensor_parallel_size"], ge=1
    )
    ring_attn_size: int = opt(1, "ring attention group size (CUDA + ring-flash-attn only)", aliases=["--ring_attn_size"], ge=1)
    ring_attn_head_stride: int = opt(1, "heads per ring-attention step", aliases=["--ring_head_stride"], ge=1)
    zpg: int = opt(
        1, "ZeRO++ hierarchical partitioning: ranks per secondary parameter copy (ZeRO-3; divides the world size)",
        aliases=["--zpg"], ge=1,
    )
    use_universal_ckpt: bool = opt(
        False, "resume from the DeepSpeed universal checkpoint latest_universal names (any world size)",
        aliases=["--use_ds_universal_ckpt"],
    )
    value_head_prefix: str = opt(
        "score", "name of the one-output value head in critic and reward checkpoints", aliases=["--value_head_prefix"]
    )
    experts_implementation: Literal["eager", "batched_mm", "grouped_mm", "deepgemm"] | None = opt(
        None, "MoE expert kernels, passed to transformers' from_pretrained (deepgemm: CUDA only)"
    )
    deepcompile: bool = opt(False, "DeepSpeed DeepCompile; refused: see docs/cli.md")
    use_liger_kernel: bool = opt(False, "Liger's fused RMSNorm, rotary (and BF16 SwiGLU) kernels in training; CUDA only", aliases=["--use_liger_kernel"])
    load_in_4bit: bool = opt(False, "4-bit base weights (QLoRA); refused: see docs/cli.md", aliases=["--load_in_4bit"])
    lora: LoraConfig = section(LoraConfig, "LoRA adapters (refused when rank > 0)")
    grad_accum_dtype: Literal["fp16", "bf16", "fp32"] | None = opt(
        None, "gradient-accumulation dtype (None = DeepSpeed's default)", aliases=["--grad_accum_dtype"]
    )


@dataclass(frozen=True)
class VLLMConfig:
    num_engines: int | None = opt(None, "number of vLLM engines (Ray mode)", aliases=["--vllm_num_engines"], ge=1)
    tensor_parallel_size: int = opt(
        1, "tensor-parallel size of each engine", aliases=["--vllm_tensor_parallel_size"], ge=1
    )
    gpu_memory_utilization: float = opt(
        0.95, "fraction of GPU memory vLLM may take", aliases=["--vllm_gpu_memory_utilization"], gt=0.0, le=1.0
    )
    kv_cache_memory_gib: float | None = opt(
        None,
        "fixed KV-cache size per engine in GiB (GPU): vLLM then skips sizing the cache from a profile of free memory, "
        "which fails when other processes on the same GPU allocate or free memory meanwhile (several runs side by side)",
        gt=0.0,
    )
    enable_sleep: bool = opt(
        False, "put engines to sleep during training (needs --train.colocate_all)", aliases=["--vllm_enable_sleep"]
    )
    enforce_eager: bool = opt(False, "disable CUDA graphs", aliases=["--enforce_eager"])
    sync_backend: Literal["auto", "nccl", "gloo", "ipc"] = opt(
        "auto", "weight-sync backend (auto: nccl on GPU, ipc with --train.colocate_all on GPU, gloo on CPU; ipc: CUDA "
        "IPC from the policy rank on each engine GPU, only with --train.colocate_all)", aliases=["--vllm_sync_backend"]
    )
    dtype: str = opt("auto", "vLLM model dtype")
    enable_prefix_caching: bool = opt(
        False, "vLLM prefix caching (emptied after every weight sync)", aliases=["--enable_prefix_caching"]
    )
    sync_with_ray: bool = opt(
        False, "no effect here (a warning): weights sync over a torch.distributed group, not ray.util.collective",
        aliases=["--vllm_sync_with_ray"],
    )


@dataclass(frozen=True)
class CkptConfig:
    output_dir: str = opt("./ckpt", "the final model (HF format) and the run's summary.json/metrics.jsonl", aliases=["--save_path"])
    path: str | None = opt(None, "checkpoint folder (default: <output_dir>/checkpoints_ppo)", aliases=["--ckpt_path"])
    save_steps: int = opt(-1, "save a checkpoint every N steps (-1 = only at the end)", aliases=["--save_steps"])
    load_enable: bool = opt(False, "resume from the latest checkpoint in --ckpt.path", aliases=["--load_checkpoint"])
    save_hf: bool = opt(False, "also export HF-format weights with each checkpoint", aliases=["--save_hf_ckpt"])
    max_num: int = opt(3, "keep at most this many checkpoints", aliases=["--max_ckpt_num"], ge=1)
    max_mem: float | None = opt(
        None, "keep each model's checkpoints under this many GiB (oldest removed first, the newest kept; default: no limit)",
        aliases=["--max_ckpt_mem"], gt=0.0,
    )
    disable_ds: bool = opt(
        False, "write no DeepSpeed (resumable) checkpoint: each checkpoint step writes an HF export instead",
        aliases=["--disable_ds_ckpt"],
    )
    best_metric_key: str = opt(
        "", "eval metric whose best value keeps a copy of the HF model ('' = the first pass1 metric, 'none' = off)"
    )


@dataclass(frozen=True)
class WandbConfig:
    key: str | None = opt(None, "wandb API key (enables wandb)", aliases=["--use_wandb"])
    project: str = opt("openrlhf_train_ppo", "wandb project", aliases=["--wandb_project"])
    run_name: str | None = opt(None, "wandb run name", aliases=["--wandb_run_name"])
    group: str | None = opt(None, "wandb group", aliases=["--wandb_group"])
    org: str | None = opt(None, "wandb entity (org)", aliases=["--wandb_org"])
    mode: Literal["online", "offline", "disabled"] = opt(
        "online", "wandb mode; offline works without a key and enables wandb by itself"
    )

    @property
    def enabled(self) -> bool:
        """wandb runs when a key is given or offline mode is asked for, unless mode is disabled."""
        return self.mode != "disabled" and (self.key is not None or self.mode == "offline")


@dataclass(frozen=True)
class LoggerConfig:
    tensorboard_dir: str | None = opt(None, "write TensorBoard logs here", aliases=["--use_tensorboard"])
    logging_steps: int = opt(1, "log metrics every N steps", aliases=["--logging_steps"], ge=1)
    wandb: WandbConfig = section(WandbConfig, "Weights & Biases logging")


@dataclass(frozen=True)
class ProfileConfig:
    step: int = opt(
        0, "profile this step's trainer phases (experience, update, weight sync) with torch.profiler: kernel times per "
        "phase as JSON (0: off)", ge=0,
    )
    dir: str | None = opt(None, "where the step's profiles go (default: <ckpt.output_dir>/profile)")
    trace: bool = opt(False, "also write a Chrome trace per phase (large: tens of MB per profiled second)")


@dataclass(frozen=True)
class PrecisionConfig:
    recipe: str = opt(
        "bf16",
        "precision recipe: bf16, fp8_rollout, jet_fp8, or a path to a .yaml/.json recipe",
        const_aliases={"--fp8_unified": "jet_fp8"},
    )
    gemm_backend: Literal["auto", "emulated", "torch", "triton", "deep_gemm", "triton_invariant"] = opt(
        "auto", "FP8 GEMM backend (auto: the recipe's choice, then the fastest available)"
    )
    strict: bool = opt(False, "refuse off-policy recipes (the rollout graph must be a subgraph of train fwd)")
    bitwise: bool = opt(
        False,
        "batch-invariant numerics in the policy's forward and the rollout engine (the transformers engine; on CUDA also "
        "vLLM with --rollout.engine vllm), so the engine's logprobs are the trainer's bit for bit; a step whose sample "
        "check proves it skips the old-logprob recompute (docs/precision.md, Bitwise mode)",
    )
    requantize_weights: bool = opt(
        False,
        "quantize each FP8 layer's weight (and, in backward, its transpose) in every call instead of keeping both until "
        "the next optimizer step: no weight memory beyond BF16's (2 bytes per weight less), at one quantization pass "
        "per call; for runs short of memory under activation checkpointing. Same bytes either way",
    )
    separate_projections: bool = opt(
        False,
        "run q/k/v and gate/up as separate FP8 GEMMs instead of one stacked GEMM per set of sibling projections (the "
        "default stacks them, forward and backward: fewer kernel launches and less host work per block, the same FP8 "
        "weight bytes; docs/precision.md, Stacked projections). Bitwise mode always runs them separately",
    )
    plain_norms: bool = opt(
        False,
        "keep the model's own RMSNorms before FP8 projections instead of fusing each with its consumers' FP8 "
        "quantization (the default fuses them on CUDA: one kernel forward, one backward; the norm's output may differ "
        "from transformers' eager formula by an ulp on a few elements, the same in every forward; docs/precision.md, "
        "Fused norms). Bitwise mode always runs its own invariant norm",
    )
    kv_cache: Literal["auto", "e4m3"] | None = opt(
        None,
        "the KV cache's format on both sides (None: the recipe's, auto unless it says otherwise): e4m3 runs vLLM's FP8 "
        "cache (scale 1.0, half the bytes attention reads per decode step) and rounds the trainer's keys and values "
        "where its attention reads them, so rollout and training still compute one function (docs/precision.md, FP8 KV "
        "cache). Needs the vLLM or transformers engine; not with --precision.bitwise",
    )
    max_mismatch: float = opt(
        0.0,
        "stop before training on a rollout whose mean |logp(engine) - logp(trainer)| per token exceeds this (0: never). "
        "A guard for what the weight digests cannot see: an engine that re-lays out a synced weight for its kernels, a "
        "stale kernel-side copy, numerics that drifted. Set it a few times above the mismatch your first steps log",
        ge=0.0,
    )
    bitwise_check_samples: int = opt(
        2,
        "with --precision.bitwise: sequences per rank recomputed each step to prove the engine's logprobs exact "
        "(0: never use them, recompute every sequence)",
        ge=0,
    )

    def load_recipe(self, policy: bool = True):
        """The `jetrl_precision.PrecisionRecipe`, with --precision.gemm_backend applied when not auto.

        `policy=False`: the reference's and the critic's. In the bitwise mode only the policy's forward must compute
        the engine's bits, so theirs keep the recipe's numerics on the fastest GEMM (auto)."""
        from jetrl_precision.recipe import get_recipe  # lazy: keeps `--help` free of torch

        recipe = get_recipe(self.recipe)
        if self.kv_cache is not None and self.kv_cache != recipe.kv_cache:
            recipe = recipe.replace(kv_cache=self.kv_cache)
        if self.bitwise and not policy:
            return recipe.replace(gemm_backend="auto")
        return recipe if self.gemm_backend == "auto" else recipe.replace(gemm_backend=self.gemm_backend)


@dataclass(frozen=True)
class PPOConfig:
    """The whole run. Build it with `parse_config`; read derived values through the properties."""

    actor: ActorConfig = section(ActorConfig, "policy model, PPO loss and schedule")
    ref: RefConfig = section(RefConfig, "reference model (for the KL term)")
    critic: CriticConfig = section(CriticConfig, "critic / value model (gae only)")
    reward: RewardConfig = section(RewardConfig, "reward: a model, a remote URL / .py function, or rule-based math")
    data: DataConfig = section(DataConfig, "prompt dataset")
    rollout: RolloutConfig = section(RolloutConfig, "generation")
    train: TrainConfig = section(TrainConfig, "optimization loop and placement")
    algo: AlgoConfig = section(AlgoConfig, "algorithm")
    ds: DeepSpeedConfig = section(DeepSpeedConfig, "DeepSpeed")
    vllm: VLLMConfig = section(VLLMConfig, "vLLM rollout engines")
    ckpt: CkptConfig = section(CkptConfig, "checkpoints and model export")
    logger: LoggerConfig = section(LoggerConfig, "logging")
    profile: ProfileConfig = section(ProfileConfig, "profiling one training step")
    precision: PrecisionConfig = section(PrecisionConfig, "precision flow shared by rollout and training (Jet-RL)")
    eval: EvalConfig = section(EvalConfig, "periodic evaluation on a held-out dataset")
    use_ms: bool = opt(False, "ModelScope hub; refused: see docs/cli.md")
    local_rank: int = opt(-1, "set by the deepspeed launcher; leave it alone", aliases=["--local-rank"])
    # Not a flag: what `validate` warned about, kept for the run's log/summary.
    cfg_warnings: tuple[str, ...] = field(default=(), metadata={"cli": False})

    # ---- derived values (never stored: the fields stay what the user passed) ----------------
    @property
    def ref_model_path(self) -> str | None:
        return self.ref.model_name_or_path or self.actor.model_name_or_path

    @property
    def needs_critic(self) -> bool:
        return self.algo.advantage.estimator == "gae"

    @property
    def critic_model_path(self) -> str | None:
        """The critic's init weights (the actor's when unset); None when the estimator needs no critic."""
        if not self.needs_critic:
            return None
        return self.critic.model_name_or_path or self.actor.model_name_or_path

    @property
    def needs_ref(self) -> bool:
        return self.algo.kl.init_coef > 0 or self.algo.kl.use_loss

    @property
    def reward_source(self) -> Literal["remote", "model", "math"]:
        """Where rewards come from: a URL/.py function, a reward model, or the rule-based math reward."""
        if self.reward.remote_url:
            return "remote"
        return "model" if self.reward.model_name_or_path else "math"

    @property
    def policy_attn_implementation(self) -> str:
        """The policy's and the transformers engine's attention: the batch-invariant one with --precision.bitwise."""
        if self.precision.bitwise:
            from jetrl_precision.batch_invariant import INVARIANT_ATTENTION  # lazy: keeps the config free of torch

            return INVARIANT_ATTENTION
        return self.ds.attn_implementation

    @property
    def packing(self) -> bool:
        """Packed forwards: asked for, or implied by dynamic batching."""
        return self.ds.packing_samples or self.train.dynamic_batch_enable

    @property
    def rollout_max_tokens_per_gpu(self) -> int:
        return self.rollout.max_tokens_per_gpu or self.train.max_tokens_per_gpu

    @property
    def ckpt_path(self) -> str:
        return self.ckpt.path or os.path.join(self.ckpt.output_dir, "checkpoints_ppo")

    @property
    def eps_clip_low(self) -> float:
        low_high = self.actor.eps_clip_low_high
        return low_high[0] if low_high is not None else self.actor.eps_clip

    @property
    def eps_clip_high(self) -> float:
        low_high = self.actor.eps_clip_low_high
        return low_high[1] if low_high is not None else self.actor.eps_clip

    # ---- serialization ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A nested plain dict (tuples become lists) for logging and YAML; `from_dict` inverts it."""
        return to_plain(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PPOConfig":
        """Rebuild from `to_dict` output (or a hand-written subset); unknown keys are an error. Not validated."""
        return from_nested(cls, cls(), data, "")

