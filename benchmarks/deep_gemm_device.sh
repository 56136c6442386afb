#!/usr/bin/env bash
# Build DeepGEMM (github.com/deepseek-ai/DeepGEMM) offline on the lent H200 and smoke-test it, in one command.
#
# The source is .dg/deepgemm-src.tar.gz (ignored, so it travels only when the device call carries `.dg`):
# DeepGEMM 2.6.1 at 54e22612 with its submodule pins CUTLASS f3fde58 (include/) and fmt 553ec11 (include/);
# its DG_SOURCE.txt says exactly what is in it.
#
#   bash benchmarks/deep_gemm_device.sh        # build (or reuse a matching build) + smoke test
#   source /tmp/dg_env.sh                      # later commands in the same device call: `import deep_gemm` works
#   source benchmarks/deep_gemm_device.sh      # both at once (the work runs in a child bash, then the env is sourced)
#
# Knobs (environment): PYTHON (python3), DG_ARCHIVE (.dg/deepgemm-src.tar.gz), DG_SRC (/tmp/dg), DG_SITE (/tmp/dgsite),
# DG_JIT_CACHE_DIR (/tmp/dgcache), DG_ENV_FILE (/tmp/dg_env.sh), DG_JIT_USE_RUNTIME_API=1 (load and launch the JIT
# kernels through the CUDA runtime API instead of dlsym-ed driver symbols), DG_REBUILD=1 (ignore a matching earlier build),
# DG_CXX_STD (c++20; the host extension's standard), DG_STATIC_LIBSTDCXX (1), DG_SKIP_SMOKE=1, DG_TRY_NVRTC=1 (also time NVRTC; it becomes the default only if it works and is faster).

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
  # Sourced: run the work in a child bash so `set -e` never reaches the caller's shell, then take the env.
  bash "${BASH_SOURCE[0]}" "$@" && source "${DG_ENV_FILE:-/tmp/dg_env.sh}"
  return $?
fi

set -euo pipefail

step() { echo "== deep_gemm_device: $*"; }
die() { echo "deep_gemm_device: ERROR: $*" >&2; exit 1; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
ARCHIVE=${DG_ARCHIVE:-$REPO/.dg/deepgemm-src.tar.gz}
SRC=${DG_SRC:-/tmp/dg}
SITE=${DG_SITE:-/tmp/dgsite}
CACHE=${DG_JIT_CACHE_DIR:-/tmp/dgcache}
ENV_FILE=${DG_ENV_FILE:-/tmp/dg_env.sh}
LOG=$SITE.build.log  # one per build dir, so two builds can run side by side

# ---- 0. inputs -------------------------------------------------------------------------------------
[[ -f "$ARCHIVE" ]] || die "no $ARCHIVE: .dg/ is git-ignored, so the device call must carry it (carry: [\".dg\"])"
command -v "$PY" >/dev/null || die "no $PY on PATH"
PYINFO=$("$PY" -c 'import sys, torch; print(sys.executable, sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)') \
  || die "$PY cannot import torch"
step "python: $PYINFO"
# setup.py imports these at the top; nothing can be installed there, so say which one is missing.
"$PY" -c 'import setuptools, packaging.version, wheel.bdist_wheel' 2>/dev/null \
  || die "DeepGEMM's setup.py needs setuptools, packaging and wheel (wheel.bdist_wheel) importable by $PY; carry the missing wheel in .whl/"

# ---- 1. CUDA_HOME ----------------------------------------------------------------------------------
# Not dirname(dirname(which nvcc)): on these images /usr/local/bin/nvcc can be a wrapper script, which
# would give /usr/local. nvcc itself says where it lives (its _HERE_ in a dry run); torch's
# cpp_extension and deep_gemm's JIT both read CUDA_HOME, so it is exported for the build and the runtime.
if [[ -z "${CUDA_HOME:-}" || ! -x "${CUDA_HOME:-/nonexistent}/bin/nvcc" ]]; then
  NVCC=$(command -v nvcc) || die "nvcc is not on PATH and CUDA_HOME is not set"
  HERE=$(cd /tmp && "$NVCC" --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p' | head -n 1 || true)
  if [[ -n "$HERE" && -x "$HERE/nvcc" ]]; then CUDA_HOME=$(dirname "$HERE"); else CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$NVCC")")"); fi
fi
export CUDA_HOME
[[ -x "$CUDA_HOME/bin/nvcc" && -f "$CUDA_HOME/include/cuda.h" ]] || die "CUDA_HOME=$CUDA_HOME has no bin/nvcc or include/cuda.h"
step "CUDA_HOME=$CUDA_HOME ($("$CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/nvcc \1/p'))"

# ---- 2. headers and libraries outside CUDA_HOME ----------------------------------------------------
# A pip-assembled toolkit may lack nvrtc/cuBLAS/cuSPARSE/cuSOLVER headers (torch's ATen/cuda/CUDAContext.h
# includes the last three) and the unversioned libnvrtc.so that `-lnvrtc` needs; torch's own nvidia-*
# wheels have them (nvidia/cu13/{include,lib}, libnvrtc.so.13 only). Found ones go to CPLUS_INCLUDE_PATH
# (searched after setup.py's -I dirs), a link dir of unversioned symlinks (LIBRARY_PATH) and an rpath.
NV_DIRS=$("$PY" -c 'import nvidia; print("\n".join(nvidia.__path__))' 2>/dev/null || true)
SEARCH_INC=("$CUDA_HOME/include" "$CUDA_HOME"/targets/*/include)
SEARCH_LIB=("$CUDA_HOME/lib64" "$CUDA_HOME/lib" "$CUDA_HOME"/targets/*/lib)
while IFS= read -r d; do
  [[ -n "$d" ]] || continue
  while IFS= read -r x; do SEARCH_INC+=("$x"); done < <(find "$d" -maxdepth 3 -type d -name include 2>/dev/null)
  while IFS= read -r x; do SEARCH_LIB+=("$x"); done < <(find "$d" -maxdepth 3 -type d -name lib 2>/dev/null)
done <<< "$NV_DIRS"

EXTRA_INC=()
for h in cuda_runtime.h nvrtc.h cublasLt.h cublas_v2.h cusparse.h cusolverDn.h; do
  [[ -f "$CUDA_HOME/include/$h" ]] && continue
  found=""
  for d in "${SEARCH_INC[@]}"; do [[ -f "$d/$h" ]] && { found=$d; break; }; done
  [[ -n "$found" ]] || die "header $h is in neither $CUDA_HOME/include nor the python nvidia packages (${NV_DIRS//$'\n'/ })"
  [[ " ${EXTRA_INC[*]} " == *" $found "* ]] || EXTRA_INC+=("$found")
done
# CUTLASS includes <cuda/std/utility>: CUDA 13 keeps it in include/cccl (setup.py adds that dir), CUDA 12 in include/.
if [[ ! -e "$CUDA_HOME/include/cccl/cuda/std/utility" && ! -e "$CUDA_HOME/include/cuda/std/utility" ]]; then
  found=""
  for d in "${SEARCH_INC[@]}"; do
    for c in "$d/cccl" "$d"; do [[ -e "$c/cuda/std/utility" ]] && { found=$c; break 2; }; done
  done
  [[ -n "$found" ]] || die "no CCCL headers (cuda/std/utility) under $CUDA_HOME/include or the nvidia packages"
  EXTRA_INC+=("$found")
fi
if ((${#EXTRA_INC[@]})); then
  joined=$(IFS=:; echo "${EXTRA_INC[*]}")
  export CPLUS_INCLUDE_PATH="$joined${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
  step "headers from outside CUDA_HOME: $joined"
fi

LINKDIR=$SITE.linklibs
rm -rf "$LINKDIR"; mkdir -p "$LINKDIR"
RPATHS=()
for lib in cudart nvrtc; do
  found=""
  for d in "${SEARCH_LIB[@]}"; do
    [[ -e "$d/lib$lib.so" ]] && { found="$d/lib$lib.so"; break; }
    cand=$(ls "$d"/lib$lib.so.[0-9]* 2>/dev/null | head -n 1 || true)
    [[ -n "$cand" ]] && { found=$cand; break; }
  done
  [[ -n "$found" ]] || die "lib$lib.so(.N) is in neither $CUDA_HOME/lib64 nor the python nvidia packages"
  if [[ "$found" != "$CUDA_HOME/lib64/lib$lib.so" ]]; then
    ln -sf "$found" "$LINKDIR/lib$lib.so"
    step "link: lib$lib.so -> $found"
  fi
  d=$(dirname "$(readlink -f "$found")")
  [[ " ${RPATHS[*]} " == *" $d "* ]] || RPATHS+=("$d")
done
export LIBRARY_PATH="$LINKDIR${LIBRARY_PATH:+:$LIBRARY_PATH}"
# setuptools appends $LDFLAGS to the link line: the rpath lets deep_gemm._C find libnvrtc.so.13 at import
# without LD_LIBRARY_PATH (torch itself loads nvrtc lazily, so it is not there yet when _C loads).
for d in "${RPATHS[@]}"; do export LDFLAGS="${LDFLAGS:+$LDFLAGS }-Wl,-rpath,$d"; done
# DG_STATIC_LIBSTDCXX (default 1): link a private, hidden libstdc++ into deep_gemm._C, so its locale
# machinery (std::regex, streams) cannot bind to another copy of the facets in the torch process. On the
# H200 image the shared-libstdc++ build SIGSEGVs in its first JIT call (in std::regex, and, with the regexes
# replaced, still in the first bf16/fp8 GEMM); the static one passes every test.
if [[ "${DG_STATIC_LIBSTDCXX:-1}" == 1 ]]; then
  export LDFLAGS="$LDFLAGS -static-libstdc++ -Wl,--exclude-libs,ALL"
  step "linking libstdc++ statically into _C (hidden)"
fi

# ---- 3. unpack + build (or reuse) ------------------------------------------------------------------
SHA=$(sha256sum "$ARCHIVE" | cut -d' ' -f1)
STAMP="$SHA $CUDA_HOME $("$PY" -c 'import sys, torch; print(sys.version.split()[0], torch.__version__)')"
if [[ "${DG_REBUILD:-0}" != 1 && -f "$SITE/.dg_stamp" && "$(cat "$SITE/.dg_stamp")" == "$STAMP" ]] && ls "$SITE"/deep_gemm/_C*.so >/dev/null 2>&1; then
  step "reusing the build in $SITE (same archive, CUDA_HOME, python and torch; DG_REBUILD=1 forces a rebuild)"
else
  step "unpacking $(basename "$ARCHIVE") (sha256 ${SHA:0:12}) into $SRC"
  rm -rf "$SRC" "$SITE"; mkdir -p "$SRC" "$SITE"
  tar -xzf "$ARCHIVE" -C "$SRC" --strip-components=1 || die "cannot unpack $ARCHIVE"
  sed -n '2p;5,6p' "$SRC/DG_SOURCE.txt" | sed 's/^/   /'
  # std::regex crashes inside this torch process (H200 image, torch 2.11: a SIGSEGV in
  # collate<char>::transform while compiling a bracket expression, seen with cuda-gdb in DeepGEMM's
  # IncludeParser): torch's libraries and the system libstdc++ disagree on the locale facets. DeepGEMM
  # uses std::regex only for three fixed patterns, so they are replaced by plain string scans (same
  # matches) before building. The patched files stay in the ignored build tree.
  "$PY" "$REPO/examples/scripts/deep_gemm_no_regex.py" "$SRC" || die "could not patch DeepGEMM's std::regex uses"
  # DG_CXX_STD (default c++20): the host extension's C++ standard. DeepGEMM hard-codes c++17; torch >= 2.10
  # builds its own extensions as c++20, and the H200 run that got furthest used c++20.
  DG_CXX_STD=${DG_CXX_STD:-c++20}
  if [[ "$DG_CXX_STD" != c++17 ]]; then
    sed -i "s/'-std=c++17'/'-std=${DG_CXX_STD}'/" "$SRC/setup.py"
    grep -q -- "-std=${DG_CXX_STD}" "$SRC/setup.py" || die "could not set -std=${DG_CXX_STD} in setup.py"
    step "host extension built with -std=${DG_CXX_STD}"
  fi
  # DG_FORCE_BUILD=1: never try the prebuilt wheel on GitHub (no network). DG_USE_LOCAL_VERSION=0: no
  # `git status`/`git rev-parse` (the unpacked tree is no git repo); the version stays plain 2.6.1.
  # DG_JIT_CACHE_DIR is baked into deep_gemm/envs.py as the default cache dir.
  # TORCH_CUDA_ARCH_LIST only silences torch's arch guess: the extension has no .cu file, kernels are JIT-built.
  export DG_FORCE_BUILD=1 DG_USE_LOCAL_VERSION=0 DG_SKIP_CUDA_BUILD=0 DG_JIT_CACHE_DIR="$CACHE"
  export MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
  t0=$(date +%s.%N)
  if "$PY" -m pip --version >/dev/null 2>&1; then
    step "building with pip (no index, no build isolation, no deps) into $SITE; log: $LOG"
    ( cd "$SRC" && "$PY" -m pip install -v --no-build-isolation --no-deps --no-index --no-cache-dir --target "$SITE" . ) >"$LOG" 2>&1 \
      || { { grep -nE "error|Error|ERROR|not found|No such file" "$LOG" | tail -n 40 >&2; tail -n 30 "$LOG" >&2; } || true; [[ -n "${OUT:-}" ]] && cp "$LOG" "$OUT/"; die "build failed (full log: $LOG${OUT:+, copied to \$OUT})"; }
  else
    step "no pip for $PY: setup.py build + copy into $SITE; log: $LOG"
    ( cd "$SRC" && "$PY" setup.py build && cp -r build/lib*/deep_gemm "$SITE/" ) >"$LOG" 2>&1 \
      || { { grep -nE "error|Error|ERROR|not found|No such file" "$LOG" | tail -n 40 >&2; tail -n 30 "$LOG" >&2; } || true; [[ -n "${OUT:-}" ]] && cp "$LOG" "$OUT/"; die "build failed (full log: $LOG)"; }
  fi
  t1=$(date +%s.%N)
  step "build wall time: $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f s", b - a }')"
  [[ -n "${OUT:-}" ]] && cp "$LOG" "$OUT/" || true
  ls "$SITE"/deep_gemm/_C*.so >/dev/null 2>&1 || die "the build finished but $SITE/deep_gemm/_C*.so is missing (log: $LOG)"
  for d in deep_gemm cute cutlass; do
    [[ -d "$SITE/deep_gemm/include/$d" ]] || die "$SITE/deep_gemm/include/$d is missing: the JIT needs it (setup.py's build_py copies it)"
  done
  echo "$STAMP" > "$SITE/.dg_stamp"
fi

# Shared libraries _C cannot resolve (beyond those torch loads first): add their dirs to LD_LIBRARY_PATH.
EXTRA_LD=()
missing=$(ldd "$SITE"/deep_gemm/_C*.so 2>/dev/null | awk '/not found/ { print $1 }' | grep -vE '^lib(c10|torch|c10_cuda|torch_cuda|torch_cpu|torch_python)\.so' || true)
for lib in $missing; do
  found=""
  for d in "${SEARCH_LIB[@]}"; do [[ -e "$d/$lib" ]] && { found=$d; break; }; done
  [[ -n "$found" ]] || { echo "deep_gemm_device: WARNING: _C needs $lib and it was not found; import may fail" >&2; continue; }
  [[ " ${EXTRA_LD[*]} " == *" $found "* ]] || EXTRA_LD+=("$found")
done

# ---- 4. runtime env file ---------------------------------------------------------------------------
# NVCC by default: this commit's NVRTC path passes only -I$CUDA_HOME/include, and CUDA 13 keeps
# <cuda/std/...> (which CUTLASS needs) in include/cccl, which nvcc adds on its own (nvcc.profile) and NVRTC
# does not. DG_TRY_NVRTC=1 measures it and switches only if it works and is faster.
write_env() {
  {
    echo "# written by benchmarks/deep_gemm_device.sh; source it before python3 -c 'import deep_gemm'"
    echo "export CUDA_HOME='$CUDA_HOME'"
    echo "export DG_JIT_CACHE_DIR='$CACHE'"
    echo "export DG_JIT_USE_NVRTC=$1"
    echo "case \":\${PYTHONPATH:-}:\" in *':$SITE:'*) ;; *) export PYTHONPATH='$SITE'\${PYTHONPATH:+:\$PYTHONPATH} ;; esac"
    if ((${#EXTRA_LD[@]})); then
      echo "export LD_LIBRARY_PATH='$(IFS=:; echo "${EXTRA_LD[*]}")'\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
    fi
  } > "$ENV_FILE"
}
write_env 0
mkdir -p "$CACHE"
step "env file $ENV_FILE:"; sed 's/^/   /' "$ENV_FILE"

[[ "${DG_SKIP_SMOKE:-0}" == 1 ]] && { step "smoke test skipped (DG_SKIP_SMOKE=1)"; exit 0; }

# ---- 5. smoke test ---------------------------------------------------------------------------------
# fprop 256x512 @ (512x512)^T: A 1x128 scales MN-major (strides (1, M), M % 4 == 0 is TMA-aligned so
# DeepGEMM uses them without a copy), B 128x128 scales (N/128, K/128) row-major, bf16 out; then the
# wgrad form (both 1x128 along K, recipe (1, 1, 128), fp32 D accumulated into C=D). Each 128-group has its
# own magnitude, so a misread scale shows up as an O(1) error. The first call includes the JIT compile.
SMOKE=$(cat <<'PYEOF'
import os, sys, time
import torch
import deep_gemm

only_fprop = len(sys.argv) > 1 and sys.argv[1] == "fprop"
print(f"deep_gemm {deep_gemm.__version__} from {os.path.dirname(deep_gemm.__file__)}; "
      f"JIT={'NVRTC' if os.environ.get('DG_JIT_USE_NVRTC') == '1' else 'NVCC'} cache={os.environ.get('DG_JIT_CACHE_DIR')}")
cap = torch.cuda.get_device_capability()
if cap[0] != 9:
    sys.exit(f"smoke: these are DeepGEMM's sm90 kernels; this GPU is sm{cap[0]}{cap[1]}")
torch.backends.cuda.matmul.allow_tf32 = False
dev, M, N, K = "cuda", 256, 512, 512
g = torch.Generator(device=dev).manual_seed(0)
mag = lambda r, c: torch.exp(torch.randn(r, c, generator=g, device=dev))
x = torch.randn(M, K, generator=g, device=dev) * mag(M, K // 128).repeat_interleave(128, 1)
w = 0.02 * torch.randn(N, K, generator=g, device=dev) * mag(N // 128, K // 128).repeat_interleave(128, 0).repeat_interleave(128, 1)

def q_1x128(t):  # e4m3 data + (rows, K/128) fp32 scales, s = amax / 448 (no power-of-2 rounding)
    r, k = t.shape
    s = t.view(r, k // 128, 128).abs().amax(-1).clamp_min(1e-10) / 448.0
    return (t.view(r, k // 128, 128) / s[..., None]).to(torch.float8_e4m3fn).view(r, k), s

def q_128x128(t):
    n, k = t.shape
    s = t.view(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3)).clamp_min(1e-10) / 448.0
    return (t.view(n // 128, 128, k // 128, 128) / s[:, None, :, None]).to(torch.float8_e4m3fn).view(n, k), s

deq_1x128 = lambda q, s: (q.float().view(q.shape[0], -1, 128) * s[..., None]).view(q.shape)
deq_128 = lambda q, s: (q.float().view(s.shape[0], 128, s.shape[1], 128) * s[:, None, :, None]).view(q.shape)
mn_major = lambda s: s.t().contiguous().t()  # (rows, G) values in a (G, rows) buffer: strides (1, rows)
rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()

def timed(fn):
    torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); torch.cuda.synchronize()
    return time.perf_counter() - t0

a8, sa = q_1x128(x)
b8, sb = q_128x128(w)
sa_mn = mn_major(sa)
assert sa_mn.stride() == (1, M)
ref = deq_1x128(a8, sa) @ deq_128(b8, sb).t()
d = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=dev)
call = lambda: deep_gemm.fp8_gemm_nt((a8, sa_mn), (b8, sb.contiguous()), d, disable_ue8m0_cast=True)
t_first = timed(call)
t_second = timed(call)
err = rel(d, ref)
print(f"fprop  1x128 . 128x128 -> bf16: rel err {err:.3e} (bf16 rounding floor ~1.7e-3); "
      f"first call {t_first:.2f} s (JIT compile), second {t_second * 1e3:.3f} ms")
ok = bool(torch.isfinite(d).all()) and err < 5e-3
if not only_fprop:
    bw8, sbw = q_1x128(w)
    ref2 = deq_1x128(a8, sa) @ deq_1x128(bw8, sbw).t()
    d32 = torch.zeros((M, N), dtype=torch.float32, device=dev)
    call2 = lambda: deep_gemm.fp8_gemm_nt((a8, sa_mn), (bw8, mn_major(sbw)), d32, c=d32, recipe=(1, 1, 128),
                                          disable_ue8m0_cast=True)
    t2 = timed(call2)
    err2 = rel(d32, ref2)
    call2()  # C == D: the second call adds the product once more
    err3 = rel(d32, 2 * ref2)
    print(f"wgrad  1x128 . 1x128 recipe (1,1,128) -> fp32 into C=D: rel err {err2:.3e}, after a second "
          f"accumulating call {err3:.3e}; first call {t2:.2f} s (JIT compile)")
    ok = ok and err2 < 1e-3 and err3 < 1e-3
print(f"JIT_FIRST_CALL_S={t_first:.3f}")
sys.exit(0 if ok else "smoke: DeepGEMM's result is wrong (see the errors above)")
PYEOF
)
step "smoke test (NVCC JIT, cache $CACHE)"
( source "$ENV_FILE" && timeout 600 "$PY" -c "$SMOKE" ) 2>&1 | tee $SITE.smoke.log \
  || die "smoke test failed (import, JIT compile or wrong result; output above, also in $SITE.smoke.log)"
nvcc_s=$(sed -n 's/^JIT_FIRST_CALL_S=//p' $SITE.smoke.log)

if [[ "${DG_TRY_NVRTC:-0}" == 1 ]]; then
  step "NVRTC trial (separate cache ${CACHE}-nvrtc)"
  if out=$(source "$ENV_FILE" && DG_JIT_USE_NVRTC=1 DG_JIT_CACHE_DIR="${CACHE}-nvrtc" timeout 300 "$PY" -c "$SMOKE" fprop 2>&1); then
    echo "$out"
    nvrtc_s=$(echo "$out" | sed -n 's/^JIT_FIRST_CALL_S=//p')
    if awk -v a="$nvrtc_s" -v b="$nvcc_s" 'BEGIN { exit !(a < b) }'; then
      write_env 1; step "NVRTC works and compiled faster (${nvrtc_s} s vs NVCC ${nvcc_s} s): $ENV_FILE now sets DG_JIT_USE_NVRTC=1"
    else
      step "NVRTC works but was not faster (${nvrtc_s} s vs NVCC ${nvcc_s} s): keeping NVCC"
    fi
  else
    echo "$out" | tail -n 15
    step "NVRTC failed (shown above): keeping NVCC"
  fi
fi
step "OK: source $ENV_FILE, then import deep_gemm"
