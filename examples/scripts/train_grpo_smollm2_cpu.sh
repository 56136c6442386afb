#!/usr/bin/env bash
# GRPO --fp8_unified on the real SmolLM2-135M-Instruct, on CPU (hidden 576: not a multiple of 128).
# A few steps to see the flow (precision check, FP8 sync, mismatch) on a pretrained model; it is slow on CPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false \
       VLLM_NO_USAGE_STATS=1 VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=2
WORK=${WORK:-runs/smollm2}
[ -f "$WORK/model/config.json" ] || python examples/scripts/prepare_smollm2.py --out "$WORK/model"
python - <<PY
from openrlhf.datasets.synthetic import make_arithmetic_records, write_jsonl
write_jsonl(make_arithmetic_records(256, difficulty=2, seed=0), "$WORK/prompts.jsonl")
PY

MODEL_ARGS=(--actor.model_name_or_path "$WORK/model" --ds.param_dtype fp32 --ds.zero_stage 2)
DATA_ARGS=(--data.prompt_dataset "$WORK/prompts.jsonl" --data.input_key input --data.label_key label
           --data.apply_chat_template --data.input_template "Compute {} Answer with the number only." --data.max_len 256)
ROLLOUT_ARGS=(--rollout.batch_size 4 --rollout.n_samples_per_prompt 4 --rollout.max_new_tokens 48
              --rollout.temperature 1.0 --rollout.micro_batch_size 8 --rollout.engine "${ENGINE:-auto}")
TRAIN_ARGS=(--train.batch_size 16 --train.micro_batch_size 4 --train.max_steps "${STEPS:-3}" --actor.adam.lr 1e-6 --train.eval_prompts 64)
ALGO_ARGS=(--algo.advantage.estimator group_norm --algo.kl.init_coef 0.001 --algo.kl.use_loss --algo.kl.estimator k3)
LOG_ARGS=(--ckpt.output_dir "$WORK/grpo" --ckpt.save_steps -1 --logger.tensorboard_dir "$WORK/grpo/tensorboard")

python -m openrlhf.cli.train_ppo_ray --fp8_unified "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${ROLLOUT_ARGS[@]}" \
    "${TRAIN_ARGS[@]}" "${ALGO_ARGS[@]}" "${LOG_ARGS[@]}" "$@"
