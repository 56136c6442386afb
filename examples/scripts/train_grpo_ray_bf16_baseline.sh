#!/usr/bin/env bash
# BF16 baseline for A/B comparison with train_grpo_ray_fp8_unified.sh: the same job (model, data,
# layout, hyper-parameters, seed), with rollout and training both in BF16.
set -euo pipefail
RECIPE=bf16 exec bash "$(dirname "$0")/train_grpo_ray_fp8_unified.sh" "$@"
