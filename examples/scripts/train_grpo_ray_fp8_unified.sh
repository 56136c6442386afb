#!/usr/bin/env bash
# GRPO with the unified FP8 precision flow (Jet-RL) in Ray mode: one node, 8 GPUs, everything
# colocated (hybrid engine): 8 DeepSpeed ZeRO-3 policy ranks, the reference model and 8 vLLM
# engines share the GPUs; the engines sleep while the policy trains. Rollout and training run the
# same FP8 quantization, and the policy's FP8 bytes + scales are synced into the engines as is.
#
#   ray start --head --node-ip-address 0.0.0.0 --num-gpus 8
#   MODEL=meta-llama/Llama-3.1-8B-Instruct DATA=/data/math/train.jsonl bash examples/scripts/train_grpo_ray_fp8_unified.sh
#
# A/B baselines with everything else identical: train_grpo_ray_bf16_baseline.sh and
# train_grpo_ray_fp8_rollout_tis.sh (they call this script with RECIPE=bf16 / fp8_rollout).
# Larger models: TP=2/4/8 splits each engine over that many GPUs (8/TP engines); every worker installs its
# slice of the FP8 bytes, and the run refuses, in one line, a TP whose shards would cut a 128x128 FP8 block.
set -euo pipefail

MODEL=${MODEL:-meta-llama/Llama-3.1-8B-Instruct}
DATA=${DATA:?set DATA to a prompt dataset: .jsonl/.json/.parquet or a local HF datasets folder}
RECIPE=${RECIPE:-jet_fp8}
SAVE=${SAVE:-./ckpt/llama3.1-8b-grpo-ray-${RECIPE}}
RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}
TP=${TP:-1}                                  # GPUs per vLLM engine
WORKDIR=${WORKDIR:-$(cd "$(dirname "$0")/../.." && pwd)}   # shipped to the cluster by `ray job submit`

RAY_ARGS=(
   --actor.num_nodes 1 --actor.num_gpus_per_node 8
   --ref.num_nodes 1 --ref.num_gpus_per_node 8
   --vllm.num_engines $((8 / TP)) --vllm.tensor_parallel_size "$TP"
   --train.colocate_all                      # policy + ref + engines on the same 8 GPUs
   --vllm.gpu_memory_utilization 0.6 --vllm.enable_sleep
)
if [ "$RECIPE" = jet_fp8 ]; then
   PRECISION_ARGS=(--fp8_unified)            # = --precision.recipe jet_fp8
elif [ "$RECIPE" = fp8_rollout ]; then       # FP8 rollout, BF16 training: off-policy, needs IS correction
   PRECISION_ARGS=(--precision.recipe fp8_rollout
                   --algo.advantage.is_correction_enable --algo.advantage.is_correction_type tis
                   --algo.advantage.is_correction_threshold 0.5 5.0)
else
   PRECISION_ARGS=(--precision.recipe "$RECIPE")
fi
MODEL_ARGS=(
   --actor.model_name_or_path "$MODEL"
   --ds.zero_stage 3 --ds.param_dtype bf16
   --actor.gradient_checkpointing_enable
)
DATA_ARGS=(
   --data.prompt_dataset "$DATA" --data.input_key problem --data.label_key answer
   --data.apply_chat_template --data.max_len 5120
)
ROLLOUT_ARGS=(
   --rollout.batch_size 128 --rollout.n_samples_per_prompt 8
   --rollout.max_new_tokens 4096 --rollout.temperature 1.0
   --rollout.micro_batch_size 8 --rollout.engine vllm
)
TRAIN_ARGS=(
   --train.batch_size 256 --train.micro_batch_size 2
   --train.num_episodes 1 --train.seed 42
   --actor.adam.lr 1e-6 --actor.lr_warmup_ratio 0.03 --actor.max_norm 1.0
)
ALGO_ARGS=(
   --algo.advantage.estimator group_norm     # GRPO
   --algo.kl.init_coef 0.001 --algo.kl.use_loss --algo.kl.estimator k3
   --actor.eps_clip_low_high 0.2 0.28        # clip-higher
)
CKPT_ARGS=(
   --ckpt.output_dir "$SAVE" --ckpt.save_steps 20 --ckpt.max_num 3
   --ckpt.load_enable                        # resumes from $SAVE/checkpoints_ppo if a checkpoint exists
)
LOG_ARGS=(
   --logger.tensorboard_dir "$SAVE/tensorboard" --logger.logging_steps 1
   --logger.wandb.run_name "grpo-ray-${RECIPE}"
)

ray job submit --address="$RAY_ADDRESS" \
   --runtime-env-json="{\"working_dir\": \"$WORKDIR\", \"excludes\": [\"ckpt\", \"runs\", \".venv\", \".git\"]}" \
   -- python3 -m openrlhf.cli.train_ppo_ray \
   "${RAY_ARGS[@]}" "${PRECISION_ARGS[@]}" "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${ROLLOUT_ARGS[@]}" \
   "${TRAIN_ARGS[@]}" "${ALGO_ARGS[@]}" "${CKPT_ARGS[@]}" "${LOG_ARGS[@]}" "$@"
