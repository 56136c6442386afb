#!/usr/bin/env bash
# Ray mode on two H200s (the device tool's `nvidia-h200-x2` kind), offline, in stages that each fit one device call.
# benchmarks/ray_gpu.py runs the measurements; tests/gpu/test_ray_2gpu.py the 2-GPU checks; docs/benchmarks.md
# shows the results.
#
# Here, once, in the checkout's root (the CPU machine, the project's venv first on PATH):
#   bash benchmarks/h200x2_ray.sh prepare
# makes the git-ignored carry folders and prints the call sequence, checking that no call carries more than 63 MiB:
#   .vc0 .vc1        vLLM 0.26 and the 33 wheels its LLM path needs (../shared/tools/vllm-gpu/prepare.sh, reused if present)
#   .rx0 .rx1 .rx2   one xz stream split to fill the room beside .vc0 and .vc1, the rest in .rx2:
#                    Ray 2.60.0 (its 79 MB wheel without the Java jars and the dashboard's web client, which Python
#                    actors never load: 23 MB with xz), DeepSpeed 0.19.8 (a pure-Python wheel built here) and the small
#                    wheels Ray, DeepSpeed and math-verify need that the image lacks
# What the image has (../shared/ENVIRONMENT.md and the device notes' package list of the image, read 2026-11-17):
# torch 2.11, Triton, transformers, and of Ray's requirements click, filelock, msgpack, packaging, protobuf, pyyaml,
# requests; of DeepSpeed's ninja, psutil, py-cpuinfo, einops; no vLLM, Ray, DeepSpeed, jsonschema (+ referencing,
# jsonschema-specifications, rpds-py), hjson or math-verify. Those travel; `install` still adds a carried dependency
# only when the machine has no installed distribution of it, so a changed image costs an install, not a shadowed copy.
# Downloads here (pip, the registry's ordinary client; versions pinned below): `pip download --no-deps` of ray and the
# small wheels for CPython 3.12 manylinux, `pip wheel --no-deps deepspeed` (sdist only on PyPI). They are kept in
# $STAGE_TMP/rayx2_dl and reused.
#
# On the device, back to back (the machine keeps /tmp for 30 s after a call; a call removes the ignored folders it does
# not carry, so `unpack` copies what a call brings to /tmp first):
#   1. kind nvidia-h200-x2, carry [".vc0", ".rx0"]   bash benchmarks/h200x2_ray.sh unpack
#   2. carry [".vc1", ".rx1"]                        bash benchmarks/h200x2_ray.sh unpack install gputest
#   3. no carry                                      bash benchmarks/h200x2_ray.sh sync ray2
#   4. no carry                                      bash benchmarks/h200x2_ray.sh spmd1 colo2
# That is the sequence when the stream fits beside .vc0 and .vc1 (it does with a checkout of a few MiB); otherwise .rx2
# holds the rest and call 3 carries it (`unpack install gputest`), one more call. prepare prints the sequence it made.
# A call on a fresh machine (the previous one was given back) starts again from 1.
# Stages:
#   install  unpack vLLM, Ray, DeepSpeed into $STAGE_TMP/site; print versions and the GPUs torch sees
#   gputest  tests/gpu/test_ray_1gpu.py (the hybrid engine on one GPU, gloo and CUDA IPC sync) and test_ray_2gpu.py
#            (separate engine over NCCL, colocated sleep/wake, killed engine + resume, a 3-GPU layout refused; it skips
#            on one GPU, so `unpack install gputest` on a lent single GPU runs the hybrid engine alone); GPUTEST_K
#            selects tests (pytest -k) for a call that continues a cut-short one
#   sync     NCCL weight sync between the GPUs, 32-layer Llama-3.1-8B shape, bf16 and jet_fp8 (ray_nccl_sync_seconds_8b)
#   ray2     GRPO, Ray: policy (+ reference) on GPU 0, the vLLM engine on GPU 1, bf16 and jet_fp8 (ray_2gpu_step_ratio)
#   colo2    GRPO, Ray: --train.colocate_all --vllm.enable_sleep, 2 policy ranks + 2 engines on the 2 GPUs (COLO2_RECIPES,
#            default jet_fp8)
#   spmd1    GRPO on one GPU, engine colocated in the trainer's process: the baseline of the 1 -> 2 GPU scaling
#   report   the table of what ran so far
# Knobs: RECIPES ("bf16 jet_fp8"), LAYERS (8), STEPS (3; step 1 warms up), PROMPTS (32), NEW_TOKENS (512), MODE (eager:
# vLLM without CUDA graphs in every variant; default compiles, minutes per cold engine), SYNC_LAYERS (32),
# GEMM_BACKEND (torch), BUDGET (seconds a call may spend, 570), XZ_LEVEL (-9). TINY=1 runs sync/ray2/colo2/spmd1 on
# CPU with tiny models (a dry run: STAGE_TMP=/tmp/dry TINY=1 OUT=/tmp/dry bash benchmarks/h200x2_ray.sh sync ray2 report).
# Every call leaves $OUT/rayx2_res.tgz with all results so far (JSON, metrics, logs; no weights). Here:
#   mkdir -p /tmp/rayx2 && tar xzf <files_at>/rayx2_res.tgz -C /tmp/rayx2
#   python benchmarks/ray_gpu.py report --from /tmp/rayx2/res && python benchmarks/headline.py
set -uo pipefail
cd "$(dirname "$0")/.."
T=${STAGE_TMP:-/tmp}
RES=$T/rayx2/res
WORK=$T/rayx2_work
BUDGET=${BUDGET:-570}
export PYTHONPATH=$T/site:$PWD PATH=$T/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 RAY_USAGE_STATS_ENABLED=0 \
       PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_HOST_IP=${VLLM_HOST_IP:-127.0.0.1}
# NVLink multicast stays off on the lent machines (the device notes say why): every process and Ray actor inherits these
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
       NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
# Ray's memory monitor off: the lent machines' MemTotal starts near 31 GiB and grows as memory is used (the device
# notes), so the monitor would read 8B-model loads as a node about to run out and kill actors
export RAY_memory_monitor_refresh_ms=${RAY_memory_monitor_refresh_ms:-0}
RAY_PIN="ray==2.60.0"
# Ray's requirements the image lacks
RAY_DEPS="jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1"
# DeepSpeed's and math-verify's the image lacks
GW_PINS="hjson==3.1.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2"
DS_PIN="deepspeed==0.19.8"
STAGES="prepare unpack install gputest sync ray2 colo2 spmd1 report"
MiB=$((1 << 20))
LIMIT=$((63 * MiB))  # per call, checkout included: 1 MiB under the device tool's 64 MiB

left() { echo $((BUDGET - SECONDS)); }
enough() { [ "$(left)" -ge "$1" ] || { echo "$2: only $(left) s of the call's budget left; run it in the next call" >&2; return 1; }; }
size() { stat -c %s "$1"; }

stage_prepare() {  # here, not on the device
  local shared main dl
  shared=${SHARED:-$(cd "$(git rev-parse --git-common-dir)/../.." && pwd)/shared}
  main=$(git worktree list --porcelain | awk '/^worktree /{print $2; exit}')
  for d in .vc0 .vc1; do
    [ -f "$d/part" ] || { [ -f "$main/$d/part" ] && mkdir -p "$d" && cp "$main/$d/part" "$d/"; }
  done
  if [ ! -f .vc0/part ] || [ ! -f .vc1/part ]; then bash "$shared/tools/vllm-gpu/prepare.sh" || return 1; fi
  dl=$T/rayx2_dl
  mkdir -p "$dl/wheels"
  local plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux2010_x86_64"
  if ! compgen -G "$dl/ray-2.60.0-*.whl" > /dev/null; then
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d "$dl" "$RAY_PIN" || return 1
  fi
  if [ ! -f "$dl/wheels/.complete" ]; then
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d "$dl/wheels" $RAY_DEPS $GW_PINS || return 1
    python3 -m pip wheel -q --no-deps -w "$dl/wheels" "$DS_PIN" || return 1
    touch "$dl/wheels/.complete"
  fi
  # Ray without what Python actors never load: the Java workers' jars and the dashboard's web client.
  local ray_whl stage
  ray_whl=$(ls "$dl"/ray-2.60.0-*.whl | head -1)
  stage=$(mktemp -d "$T/rayx2_stage.XXXX") && mkdir -p "$stage/rayx2-carry"
  python3 - "$ray_whl" "$stage/rayx2-carry/$(basename "$ray_whl")" "$shared/tools/vllm-gpu/slim_wheel.py" <<'EOF' || return 1
import subprocess, sys, zipfile
src, dst, slim = sys.argv[1:]
drop = [n for n in zipfile.ZipFile(src).namelist() if n.startswith(("ray/jars/", "ray/dashboard/client/build/"))]
subprocess.run([sys.executable, slim, src, dst, *drop], check=True)
print(f"prepare: ray wheel without {len(drop)} files (Java jars, dashboard web client)")
EOF
  cp "$dl"/wheels/*.whl "$stage/rayx2-carry/"
  local xzs=$stage/rayx2.tar.xz
  tar cf - -C "$stage" rayx2-carry | xz "${XZ_LEVEL:--9}" -T2 > "$xzs" || return 1
  echo "prepare: $(ls "$stage/rayx2-carry" | wc -l) wheels, stream $((($(size "$xzs") + MiB - 1) / MiB)) MiB"
  # Split the stream: fill the room beside .vc0 (call 1) and .vc1 (call 2), the rest in .rx2 (call 3).
  local repo vc0 vc1 total p0 p1 r2
  repo=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
  vc0=$(size .vc0/part); vc1=$(size .vc1/part); total=$(size "$xzs")
  p0=$((LIMIT - repo - vc0)); p1=$((LIMIT - repo - vc1))
  [ "$p0" -gt 0 ] && [ "$p1" -gt 0 ] || { echo "prepare: no room beside .vc0/.vc1 (checkout $repo bytes)" >&2; return 1; }
  rm -rf .rx0 .rx1 .rx2 && mkdir -p .rx0 .rx1 .rx2
  head -c "$p0" "$xzs" > .rx0/part
  tail -c +$((p0 + 1)) "$xzs" | head -c "$p1" > .rx1/part
  tail -c +$((p0 + p1 + 1)) "$xzs" > .rx2/part
  r2=$(size .rx2/part)
  [ $((repo + r2)) -le "$LIMIT" ] || { echo "prepare: .rx2 would carry $(((repo + r2) / MiB)) MiB; too much for one call" >&2; return 1; }
  cat .rx0/part .rx1/part .rx2/part | cmp - "$xzs" || { echo "prepare: the parts do not rebuild the stream" >&2; return 1; }
  # which parts make the stream, and their sizes: `install` checks that it has exactly these
  local parts="rx0:$(size .rx0/part) rx1:$(size .rx1/part)"
  if [ "$r2" -eq 0 ]; then rm -rf .rx2; else parts="$parts rx2:$r2"; fi
  echo "$parts" > .rx0/parts
  rm -rf "$stage"
  for f in .vc0 .vc1 .rx0 .rx1 .rx2; do
    [ -e "$f" ] || continue
    if [ -n "$(git status --porcelain --ignored=no -- "$f")" ]; then echo "prepare: $f is not git-ignored" >&2; return 1; fi
  done
  mib() { echo "$1" | awk -v m="$MiB" '{printf "%5.1f MiB", $1 / m}'; }
  echo "checkout $(mib "$repo"); calls on nvidia-h200-x2, back to back:"
  echo "  1. carry [\".vc0\", \".rx0\"]  $(mib $((repo + vc0 + $(size .rx0/part))))  bash benchmarks/h200x2_ray.sh unpack"
  if [ "$r2" -eq 0 ]; then
    echo "  2. carry [\".vc1\", \".rx1\"]  $(mib $((repo + vc1 + $(size .rx1/part))))  bash benchmarks/h200x2_ray.sh unpack install gputest"
    echo "  3. no carry                  bash benchmarks/h200x2_ray.sh sync ray2"
    echo "  4. no carry                  bash benchmarks/h200x2_ray.sh spmd1 colo2"
  else
    echo "  2. carry [\".vc1\", \".rx1\"]  $(mib $((repo + vc1 + $(size .rx1/part))))  bash benchmarks/h200x2_ray.sh unpack"
    echo "  3. carry [\".rx2\"]          $(mib $((repo + r2)))  bash benchmarks/h200x2_ray.sh unpack install gputest"
    echo "  4. no carry                  bash benchmarks/h200x2_ray.sh sync ray2"
    echo "  5. no carry                  bash benchmarks/h200x2_ray.sh spmd1 colo2"
  fi
}

stage_unpack() {  # copy what this call carries out of the checkout
  for d in vc0 vc1 rx0 rx1 rx2; do [ -f ".$d/part" ] && cp ".$d/part" "$T/${d}part" && echo "unpacked .$d"; done
  [ -f .rx0/parts ] && cp .rx0/parts "$T/rxparts"
  return 0
}

rx_parts() {  # the stream's parts in order; fails naming what is missing or cut short
  local missing="" files="" p n
  [ -f "$T/rxparts" ] || { echo "install: $T/rxparts missing: run the call that carries .rx0 (unpack) first" >&2; return 1; }
  for entry in $(cat "$T/rxparts"); do
    p=${entry%%:*}; n=${entry#*:}
    if [ ! -f "$T/${p}part" ]; then missing="$missing .$p"
    elif [ "$(size "$T/${p}part")" != "$n" ]; then echo "install: $T/${p}part has $(size "$T/${p}part") bytes, prepare wrote $n" >&2; return 1
    else files="$files $T/${p}part"; fi
  done
  [ -z "$missing" ] || { echo "install: missing$missing in $T: run the calls that carry them (unpack) first" >&2; return 1; }
  echo "$files"
}

stage_install() {
  local need="" files
  for p in vc0 vc1; do [ -f "$T/${p}part" ] || need="$need .$p"; done
  if [ ! -d "$T/site/vllm" ]; then
    [ -z "$need" ] || { echo "install: missing$need in $T: run the calls that carry them (unpack) first" >&2; return 1; }
    cat "$T/vc0part" "$T/vc1part" | python3 -c "import sys,tarfile;tarfile.open(fileobj=sys.stdin.buffer,mode='r|xz').extractall('$T',filter='data')" \
      && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$T/site" "$T"/vllm-carry/*.whl || return 1
  fi
  if [ ! -d "$T/site/ray" ] || [ ! -d "$T/site/deepspeed" ]; then
    files=$(rx_parts) || return 1
    # shellcheck disable=SC2086
    cat $files | python3 -c "import sys,tarfile;tarfile.open(fileobj=sys.stdin.buffer,mode='r|xz').extractall('$T',filter='data')" || return 1
    # Ray and DeepSpeed always; a dependency only when the image has no installed distribution of it (its copy wins).
    python3 - "$T/rayx2-carry" > "$T/rayx2_wanted.txt" <<'EOF' || return 1
import sys
from importlib import metadata
from pathlib import Path
for whl in sorted(Path(sys.argv[1]).glob("*.whl")):
    name = whl.name.split("-")[0]
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        have = None
    if name.lower() in ("ray", "deepspeed") or have is None:
        print(whl)
    print(f"  {whl.name}: " + ("installing" if name.lower() in ("ray", "deepspeed") or have is None else f"skipped, {have} is installed"), file=sys.stderr)
EOF
    # shellcheck disable=SC2046
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$T/site" $(cat "$T/rayx2_wanted.txt") || return 1
  fi
  python3 -c "import vllm, ray, deepspeed, torch; print('vllm', vllm.__version__, 'ray', ray.__version__, 'deepspeed', deepspeed.__version__, 'torch', torch.__version__, 'GPUs', torch.cuda.device_count(), torch.cuda.get_device_name() if torch.cuda.is_available() else '-')"
}

stage_gputest() {
  enough 240 gputest || return 1
  mkdir -p "$RES/gputest"
  # shellcheck disable=SC2086
  timeout "$(($(left) - 10))" python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_ray_1gpu.py tests/gpu/test_ray_2gpu.py \
    ${GPUTEST_K:+-k "$GPUTEST_K"} \
    --junitxml "$RES/gputest/junit.xml" 2>&1 | tee "$RES/gputest/pytest.txt" | tail -40
}

bench() {  # ray_gpu.py with the knobs, within what is left of the call; $1: the recipes
  local recipes=$1
  shift
  # shellcheck disable=SC2086
  timeout "$(left)" python3 benchmarks/ray_gpu.py "$@" ${TINY:+--tiny} --recipes $recipes --out "$RES" --workdir "$WORK" \
    --gemm_backend "${GEMM_BACKEND:-$([ -n "${TINY:-}" ] && echo auto || echo torch)}" --deadline "$(($(left) - 20))" 2>&1 \
    | grep "^\[ray_gpu\|rror" | tail -24
}

stage_sync() {
  enough 150 sync || return 1
  bench "${RECIPES:-bf16 jet_fp8}" sync --sync_layers "${SYNC_LAYERS:-32}"
}

speed() {  # $1: the variant, $2: its recipes
  enough 150 "$1" || return 1
  bench "$2" speed --variants "$1" --layers "${LAYERS:-8}" --steps "${STEPS:-3}" --prompts "${PROMPTS:-32}" --new_tokens "${NEW_TOKENS:-512}" \
    --mode "${MODE:-eager}"
}
stage_ray2() { speed ray2 "${RECIPES:-bf16 jet_fp8}"; }
stage_colo2() { speed colo2 "${COLO2_RECIPES:-${RECIPES:-jet_fp8}}"; }  # a functional run of the variant: jet_fp8 unless asked
stage_spmd1() { speed spmd1 "${RECIPES:-bf16 jet_fp8}"; }

stage_report() {
  python3 benchmarks/ray_gpu.py report --table_only --from "$RES"
}

if [ $# -eq 0 ]; then sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2; fi
for s in "$@"; do
  case " $STAGES " in *" $s "*) ;; *) echo "h200x2_ray.sh: unknown stage '$s'; stages: $STAGES" >&2; exit 2 ;; esac
done
[ "$1" = prepare ] || mkdir -p "$RES"
rc=0
for s in "$@"; do
  echo "=== stage $s at ${SECONDS}s ($(date +%T))"
  "stage_$s" || { echo "stage $s FAILED"; rc=1; }
done
if [ -n "${OUT:-}" ] && [ -d "$T/rayx2/res" ]; then
  tar czf "$OUT/rayx2_res.tgz" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' -C "$T/rayx2" res && ls -la "$OUT"
fi
exit $rc
