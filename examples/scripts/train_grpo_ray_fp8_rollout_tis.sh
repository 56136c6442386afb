#!/usr/bin/env bash
# The common FP8 recipe for A/B comparison with train_grpo_ray_fp8_unified.sh: FP8 rollout (the
# engines quantize the synced BF16 weights themselves), BF16 training, and truncated importance
# sampling (TIS) to correct for the mismatch. The same job otherwise.
set -euo pipefail
RECIPE=fp8_rollout exec bash "$(dirname "$0")/train_grpo_ray_fp8_unified.sh" "$@"
