#!/usr/bin/env bash
# The accuracy study (docs/fidelity.md) on the lent H200, in stages that each fit one device call
# (benchmarks/fidelity_gpu.py runs it). The kit is h200_grpo.sh's: vLLM 0.26, DeepSpeed + math-verify wheels and
# SmolLM2-135M-Instruct's GGUF travel in the same git-ignored carry folders, unpacked and installed by its stages.
#
# Here, right before the calls (the checkout's root, the project's venv first on PATH):
#   bash benchmarks/h200_fidelity.sh prepare       # = h200_grpo.sh prepare: .vc0 .vc1 .gw .gs0-.gs3, sized to fit
# On the device, back to back (the machine keeps /tmp for 30 s after a call; a call that does not carry an ignored
# folder removes it, so `unpack` copies what a call brings to /tmp first):
#   1. carry [".vc0", ".gs0"]          bash benchmarks/h200_fidelity.sh unpack                       ~15 s
#   2. carry [".vc1", ".gw", ".gs1"]   bash benchmarks/h200_fidelity.sh unpack install               ~1.5 min
#   3. carry [".gs2"]                  bash benchmarks/h200_fidelity.sh unpack smollm2 learn         ~9.5 min
#   4. no carry                        bash benchmarks/h200_fidelity.sh mismatch long                ~3 min + long
# A call on a fresh machine (the previous one was given back) starts again from 1; calls 3 and 4 may swap. `long`
# samples every rollout to LONG_TOKENS past EOS (the first run, with shorter rollouts, took 6.4 min for 10 steps); it
# has not run at that length yet: give it a call of its own (`bash benchmarks/h200_fidelity.sh long`) when mismatch
# has already run.
# When prepare prints a fourth call (the checkout has grown, and the GGUF spills into .gs3), call 3 carries .gs2 for
# `unpack` and other work, and the first stage needing the model comes with carry [".gs3"]: `unpack smollm2 ...`.
# Knobs: STEPS (learn, 50), SEEDS ("0"), RUNS (learn runs, "bf16 jet_fp8 fp8_rollout fp8_rollout_tis"), LENGTHS
# ("1024 4096 8192"), BITWISE_ENGINE (the bitwise row's engine: auto = vLLM's bitwise mode on CUDA; hf), LONG_STEPS
# (10), LONG_TOKENS (4096), LONG_BUDGET (long_bg's budget, 1150 s), RUN_TIMEOUT (seconds per training run, 520), BUDGET (seconds a call may spend, 570). Each stage stops its runs at the call's budget;
# a learning run cut short keeps its steps (metrics.jsonl is written step by step).
# TINY=1 runs the stages on CPU with a tiny model (a dry run here:
#   mkdir -p /tmp/dry_fidelity && STAGE_TMP=/tmp/dry_fidelity BUDGET=1500 TINY=1 OUT=/tmp/dry_fidelity \
#     bash benchmarks/h200_fidelity.sh mismatch learn long; about 10 minutes on 2 busy cores).
# Every call leaves $OUT/fidelity_res.tgz with all results so far (JSON, metrics, logs; no weights). Here:
#   mkdir -p /tmp/fid && tar xzf <files_at>/fidelity_res.tgz -C /tmp/fid
#   python benchmarks/fidelity_gpu.py report --from /tmp/fid/res && python benchmarks/headline.py
set -uo pipefail
cd "$(dirname "$0")/.."
T=${STAGE_TMP:-/tmp}
RES=$T/fidelity/res
BUDGET=${BUDGET:-570}
export PYTHONPATH=$T/site:$PWD PATH=$T/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 \
       PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

left() { echo $((BUDGET - SECONDS)); }
enough() { [ "$(left)" -ge "$1" ] || { echo "$2: only $(left) s of the call's budget left; run it in the next call" >&2; return 1; }; }
kit() { env -u OUT STAGE_TMP="$T" bash benchmarks/h200_grpo.sh "$@"; }  # its stages and /tmp layout, no tarball of its own
model() { if [ -n "${TINY:-}" ]; then echo --tiny; else echo --model "$T/smol_hf"; fi; }
fidelity() {  # one part, cut at the call's budget (15 s kept for the tarball), then its table
  local part=$1; shift
  # shellcheck disable=SC2046
  timeout "$(left)" python3 benchmarks/fidelity_gpu.py "$part" $(model) --out "$RES" --workdir "$T/fidelity_work" \
    --deadline "$(($(left) - 15))" "$@" 2>&1 | grep "^\[fidelity\|rror" | tail -24
  python3 benchmarks/fidelity_gpu.py report --table_only --from "$RES"
}

stage_prepare() { bash benchmarks/h200_grpo.sh prepare; }
stage_unpack() { kit unpack; }
stage_install() { kit install; }
stage_smollm2() { kit smollm2; }

stage_mismatch() {
  enough 150 mismatch || return 1
  # shellcheck disable=SC2086
  fidelity mismatch --lengths ${LENGTHS:-1024 4096 8192} --bitwise_engine "${BITWISE_ENGINE:-auto}"
}

stage_learn() {
  enough 240 learn || return 1
  # shellcheck disable=SC2086
  fidelity learn --steps "${STEPS:-$([ -n "${TINY:-}" ] && echo 2 || echo 50)}" --seeds ${SEEDS:-0} --runs ${RUNS:-bf16 jet_fp8 fp8_rollout fp8_rollout_tis} \
    ${RUN_TIMEOUT:+--run_timeout "$RUN_TIMEOUT"}
}

stage_long() {
  enough 180 long || return 1
  # shellcheck disable=SC2086
  fidelity long --long_steps "${LONG_STEPS:-10}" --long_tokens "${LONG_TOKENS:-4096}" --seeds ${SEEDS:-0} \
    ${RUN_TIMEOUT:+--run_timeout "$RUN_TIMEOUT"}
}

# `long` outlasts one call (10 steps of 4k-token rollouts): `long_bg` starts it detached (setsid survives the call's
# end while the machine stays warm), `wait_bg` in the next call, back to back, waits for it and leaves the tarball.
stage_long_bg() {
  env -u OUT BUDGET="${LONG_BUDGET:-1150}" RUN_TIMEOUT="${RUN_TIMEOUT:-1000}" setsid bash benchmarks/h200_fidelity.sh long \
    > "$T/long_bg.log" 2>&1 < /dev/null &
  echo $! > "$T/long_bg.pid"
  echo "long: running detached (pid $!, log $T/long_bg.log); run wait_bg in the next call, back to back"
}

stage_wait_bg() {
  local pid
  pid=$(cat "$T/long_bg.pid" 2>/dev/null) || { echo "wait_bg: no detached run ($T/long_bg.pid missing): run long_bg first" >&2; return 1; }
  while kill -0 "$pid" 2>/dev/null && [ "$(left)" -gt 20 ]; do sleep 5; done
  kill -0 "$pid" 2>/dev/null && echo "wait_bg: still running at this call's budget; run wait_bg again"
  tail -20 "$T/long_bg.log"
}

[ $# -gt 0 ] || { sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2; }
[ "$1" = prepare ] || mkdir -p "$RES"
for s in "$@"; do
  echo "=== stage $s at ${SECONDS}s ($(date +%T))"
  "stage_$s" || echo "stage $s FAILED"
done
if [ -n "${OUT:-}" ] && [ -d "$RES" ]; then
  tar czf "$OUT/fidelity_res.tgz" --exclude='*.safetensors' --exclude='*.bin' -C "$T/fidelity" res && ls -la "$OUT"
fi
