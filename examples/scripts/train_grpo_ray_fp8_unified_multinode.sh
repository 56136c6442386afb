#!/usr/bin/env bash
# GRPO --fp8_unified in Ray mode across nodes, disaggregated: 2 nodes x 8 GPUs of DeepSpeed ZeRO-3
# policy ranks (the reference model shares their GPUs), and 8 vLLM engines on a third node. The
# policy's FP8 weights reach the engines over NCCL (a group spanning policy rank 0 and every engine).
#
# Under Slurm (3 nodes, 8 GPUs each):
#   sbatch --nodes 3 --gres gpu:8 --ntasks-per-node 1 examples/scripts/train_grpo_ray_fp8_unified_multinode.sh
# By hand:
#   head:     ray start --head --node-ip-address <HEAD_IP> --port 6379 --num-gpus 8
#   workers:  ray start --address <HEAD_IP>:6379 --num-gpus 8
#   then:     RAY_ADDRESS=http://<HEAD_IP>:8265 bash examples/scripts/train_grpo_ray_fp8_unified_multinode.sh
set -euo pipefail

MODEL=${MODEL:-meta-llama/Llama-3.1-8B-Instruct}
DATA=${DATA:?set DATA to a prompt dataset on a filesystem every node sees}
SAVE=${SAVE:-./ckpt/llama3.1-8b-grpo-ray-fp8-multinode}   # checkpoints: put this on a shared filesystem
WORKDIR=${WORKDIR:-$(cd "$(dirname "$0")/../.." && pwd)}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

if [ -n "${SLURM_JOB_ID:-}" ]; then
   # Start Ray on the allocation: the head on the first node, workers on the others.
   mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
   HEAD=${NODES[0]}
   HEAD_IP=$(srun --nodes=1 --ntasks=1 -w "$HEAD" hostname --ip-address | awk '{print $1}')
   srun --nodes=1 --ntasks=1 -w "$HEAD" ray start --head --node-ip-address="$HEAD_IP" --port=6379 \
        --num-gpus "$GPUS_PER_NODE" --block &
   sleep 15
   for node in "${NODES[@]:1}"; do
      srun --nodes=1 --ntasks=1 -w "$node" ray start --address "$HEAD_IP:6379" --num-gpus "$GPUS_PER_NODE" --block &
   done
   sleep 15
   RAY_ADDRESS="http://$HEAD_IP:8265"
fi
RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}

RAY_ARGS=(
   --actor.num_nodes 2 --actor.num_gpus_per_node "$GPUS_PER_NODE"
   --ref.num_nodes 2 --ref.num_gpus_per_node "$GPUS_PER_NODE" --train.colocate_actor_ref
   --vllm.num_engines "$GPUS_PER_NODE" --vllm.tensor_parallel_size 1     # a node of engines
   --vllm.gpu_memory_utilization 0.9 --vllm.sync_backend nccl
)
MODEL_ARGS=(--actor.model_name_or_path "$MODEL" --fp8_unified --ds.zero_stage 3 --ds.param_dtype bf16
            --actor.gradient_checkpointing_enable)
DATA_ARGS=(--data.prompt_dataset "$DATA" --data.input_key problem --data.label_key answer
           --data.apply_chat_template --data.max_len 9216)
ROLLOUT_ARGS=(--rollout.batch_size 256 --rollout.n_samples_per_prompt 8 --rollout.max_new_tokens 8192
              --rollout.temperature 1.0 --rollout.micro_batch_size 8 --rollout.engine vllm)
TRAIN_ARGS=(--train.batch_size 512 --train.micro_batch_size 2 --train.num_episodes 1 --train.seed 42
            --actor.adam.lr 1e-6 --actor.lr_warmup_ratio 0.03)
ALGO_ARGS=(--algo.advantage.estimator group_norm --algo.kl.init_coef 0.001 --algo.kl.use_loss --algo.kl.estimator k3
           --actor.eps_clip_low_high 0.2 0.28)
CKPT_ARGS=(--ckpt.output_dir "$SAVE" --ckpt.save_steps 10 --ckpt.max_num 3 --ckpt.load_enable)
LOG_ARGS=(--logger.tensorboard_dir "$SAVE/tensorboard" --logger.wandb.run_name grpo-ray-fp8-multinode)

ray job submit --address="$RAY_ADDRESS" \
   --runtime-env-json="{\"working_dir\": \"$WORKDIR\", \"excludes\": [\"ckpt\", \"runs\", \".venv\", \".git\"]}" \
   -- python3 -m openrlhf.cli.train_ppo_ray \
   "${RAY_ARGS[@]}" "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${TRAIN_ARGS[@]}" \
   "${ALGO_ARGS[@]}" "${CKPT_ARGS[@]}" "${LOG_ARGS[@]}" "$@"
