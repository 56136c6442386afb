#!/usr/bin/env bash
# Build a DeepGEMM wheel for this machine's torch and CUDA, so `--precision.gemm_backend auto` can pick it.
#
# DeepGEMM (github.com/deepseek-ai/DeepGEMM) is not on PyPI (`deep-gemm` there is a stale sdist). It compiles a
# small host extension against your torch; its GEMM kernels are JIT-compiled at first use. This script builds the
# version jetrl_precision is tested with (2.6.1, commit 54e22612) on a CUDA machine:
#
#   examples/scripts/build_deep_gemm.sh                      # clone (needs git + network), build dist/deep_gemm-*.whl
#   examples/scripts/build_deep_gemm.sh --install            # ... and pip-install it into this Python, then smoke-test
#   examples/scripts/build_deep_gemm.sh --source DIR|ARCHIVE # build from a checkout with its submodules, or from an
#                                                            # archive made by benchmarks/deep_gemm_pack.sh (offline)
#   examples/scripts/build_deep_gemm.sh --dry-run ...        # check the machine and print the plan; build nothing
#
# Options:
#   --source PATH      DeepGEMM source: a directory (setup.py, csrc/, third-party/{cutlass,fmt}/include) or a .tar.gz
#   --ref COMMIT       commit to clone when no --source is given (default: the tested 54e22612...)
#   --repo URL         repository to clone (default: https://github.com/deepseek-ai/DeepGEMM.git)
#   --wheel-dir DIR    where the wheel goes (default: ./dist)
#   --python PY        the Python whose torch the wheel is built for (default: python3)
#   --install          pip-install the wheel into that Python (--no-deps), then run the smoke test
#   --target DIR       install into DIR instead (add DIR to PYTHONPATH), then run the smoke test
#   --no-smoke         skip the smoke test after --install/--target
#   --work DIR         scratch directory for the unpacked/cloned source (default: a temporary one, removed)
#   --dry-run          run the checks, print what would be done, exit (0: ready to build, 1: something is missing)
#   -h, --help         this text
# Environment: CUDA_HOME (else found from nvcc), DG_CXX_STD (c++20), DG_STATIC_LIBSTDCXX (1: link a private
# libstdc++, which the H200 image needed), DG_PATCH_REGEX (1: replace DeepGEMM's three std::regex uses by string
# scans; std::regex crashed inside torch processes on that image), MAX_JOBS.
set -euo pipefail

DEFAULT_REF=54e22612409371d6364144b69086735beb54e98b
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "build_deep_gemm: error: $*" >&2; exit 1; }
bad_usage() { echo "build_deep_gemm: error: $*; see --help" >&2; exit 2; }
say() { echo "== build_deep_gemm: $*"; }

SOURCE="" REF=$DEFAULT_REF REPO_URL=https://github.com/deepseek-ai/DeepGEMM.git WHEEL_DIR=dist PY=python3
INSTALL=0 TARGET="" SMOKE=1 WORK="" DRY=0
need_value() { [[ $# -ge 2 && -n "$2" && "$2" != --* ]] || bad_usage "$1 needs a value"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --source) need_value "$@"; SOURCE=$2; shift 2 ;;
    --ref) need_value "$@"; REF=$2; shift 2 ;;
    --repo) need_value "$@"; REPO_URL=$2; shift 2 ;;
    --wheel-dir) need_value "$@"; WHEEL_DIR=$2; shift 2 ;;
    --python) need_value "$@"; PY=$2; shift 2 ;;
    --install) INSTALL=1; shift ;;
    --target) need_value "$@"; TARGET=$2; shift 2 ;;
    --no-smoke) SMOKE=0; shift ;;
    --work) need_value "$@"; WORK=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) bad_usage "unknown option '$1'" ;;
  esac
done
[[ $INSTALL == 1 && -n "$TARGET" ]] && bad_usage "--install and --target exclude each other (one installs into the Python, the other into a folder)"
[[ "$REF" =~ ^[0-9a-fA-F]{7,40}$ || -n "$SOURCE" ]] || bad_usage "--ref must be a commit hash (7-40 hex digits), got '$REF'"

# ---- checks: each prints one line; a missing requirement is collected, not fatal, so --dry-run lists them all ----
MISSING=()
check() { if [[ $1 == ok ]]; then echo "   ok       $2"; else echo "   MISSING  $2"; MISSING+=("$2"); fi; }
say "checks"

if [[ -n "$SOURCE" ]]; then
  if [[ -d "$SOURCE" ]]; then
    for f in setup.py csrc deep_gemm third-party/cutlass/include third-party/fmt/include; do
      [[ -e "$SOURCE/$f" ]] || { check missing "source directory $SOURCE has $f (a checkout needs 'git submodule update --init --recursive')"; }
    done
    [[ -e "$SOURCE/setup.py" && -e "$SOURCE/third-party/cutlass/include" && -e "$SOURCE/third-party/fmt/include" ]] \
      && check ok "source directory $SOURCE"
  elif [[ -f "$SOURCE" ]]; then
    if listing=$(tar -tzf "$SOURCE" 2>/dev/null) && grep -q '/setup.py$' <<<"$listing" && grep -q '/third-party/cutlass/include/' <<<"$listing"; then
      check ok "source archive $SOURCE ($(tar -xzOf "$SOURCE" --wildcards '*/DG_SOURCE.txt' 2>/dev/null | sed -n 2p || true))"
    else
      check missing "source archive $SOURCE is a DeepGEMM .tar.gz with setup.py and third-party/cutlass/include (make one with benchmarks/deep_gemm_pack.sh)"
    fi
  else
    check missing "--source $SOURCE exists"
  fi
else
  command -v git >/dev/null && check ok "git (to clone $REPO_URL at ${REF:0:12})" || check missing "git on PATH (or pass --source)"
fi

if command -v "$PY" >/dev/null 2>&1 && PYINFO=$("$PY" -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, int(torch.cuda.is_available()))' 2>/dev/null); then
  read -r PYVER TORCHVER TORCHCUDA HASGPU <<<"$PYINFO"
  check ok "$PY: Python $PYVER, torch $TORCHVER"
  [[ "$TORCHCUDA" != None ]] && check ok "torch built with CUDA $TORCHCUDA" || check missing "a CUDA build of torch ($PY has torch $TORCHVER, built without CUDA)"
  "$PY" -c 'import setuptools, packaging.version, wheel.bdist_wheel' 2>/dev/null && check ok "setuptools, packaging, wheel" \
    || check missing "setuptools, packaging and wheel importable by $PY (pip install setuptools packaging wheel)"
  "$PY" -m pip --version >/dev/null 2>&1 && check ok "pip" || check missing "pip for $PY (python -m ensurepip)"
else
  check missing "$PY runs and imports torch"
  HASGPU=0
fi

if [[ -z "${CUDA_HOME:-}" || ! -x "${CUDA_HOME:-/nonexistent}/bin/nvcc" ]]; then
  # nvcc's own dry run names its folder (_HERE_); /usr/local/bin/nvcc may be a wrapper script.
  if NVCC=$(command -v nvcc 2>/dev/null); then
    HERE=$(cd /tmp && "$NVCC" --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p' | head -n 1 || true)
    if [[ -n "$HERE" && -x "$HERE/nvcc" ]]; then CUDA_HOME=$(dirname "$HERE"); else CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$NVCC")")"); fi
  fi
fi
if [[ -n "${CUDA_HOME:-}" && -x "$CUDA_HOME/bin/nvcc" && -f "$CUDA_HOME/include/cuda.h" ]]; then
  export CUDA_HOME
  check ok "CUDA toolkit $CUDA_HOME ($("$CUDA_HOME/bin/nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/nvcc \1/p'))"
else
  check missing "a CUDA toolkit: nvcc on PATH or CUDA_HOME with bin/nvcc and include/cuda.h"
fi
[[ "$HASGPU" == 1 ]] && echo "   ok       a GPU is visible (the smoke test can run)" \
  || echo "   note     no GPU visible: the wheel builds, the smoke test is skipped (DeepGEMM's kernels need sm90)"

WHEEL_DIR=$(realpath -m "$WHEEL_DIR")
say "plan"
echo "   source:  ${SOURCE:-clone $REPO_URL at $REF (with submodules)}"
echo "   build:   $PY -m pip wheel --no-index --no-build-isolation --no-deps -w $WHEEL_DIR <source>"
echo "            (DG_FORCE_BUILD=1, DG_USE_LOCAL_VERSION=0, -std=${DG_CXX_STD:-c++20}, static libstdc++ ${DG_STATIC_LIBSTDCXX:-1}, std::regex patch ${DG_PATCH_REGEX:-1})"
[[ $INSTALL == 1 ]] && echo "   install: $PY -m pip install --no-deps --force-reinstall <wheel>"
[[ -n "$TARGET" ]] && echo "   install: $PY -m pip install --no-deps --target $TARGET <wheel>; then PYTHONPATH=$TARGET"
[[ ($INSTALL == 1 || -n "$TARGET") && $SMOKE == 1 ]] && echo "   smoke:   one fprop and one wgrad GEMM against a float64 reference (needs an sm90 GPU)"
if ((${#MISSING[@]})); then
  echo "build_deep_gemm: missing: $(IFS=';'; echo "${MISSING[*]}")" >&2
  exit 1
fi
[[ $DRY == 1 ]] && { say "dry run: ready to build"; exit 0; }

# ---- source ---------------------------------------------------------------------------------------------------
CLEAN_WORK=0
if [[ -z "$WORK" ]]; then WORK=$(mktemp -d); CLEAN_WORK=1; fi
trap '[[ $CLEAN_WORK != 1 ]] || rm -rf "$WORK"' EXIT
SRC=$WORK/deepgemm-src
rm -rf "$SRC"
if [[ -z "$SOURCE" ]]; then
  say "cloning $REPO_URL at $REF"
  git clone --quiet "$REPO_URL" "$SRC" || die "git clone $REPO_URL failed (offline? pass --source)"
  git -C "$SRC" checkout --quiet "$REF" || die "commit $REF is not in $REPO_URL"
  git -C "$SRC" submodule update --quiet --init --recursive third-party/cutlass third-party/fmt || die "could not fetch the cutlass/fmt submodules"
elif [[ -d "$SOURCE" ]]; then
  say "copying $SOURCE"
  mkdir -p "$SRC" && (cd "$SOURCE" && tar --exclude=.git -cf - .) | tar -xf - -C "$SRC"
else
  say "unpacking $SOURCE"
  mkdir -p "$SRC" && tar -xzf "$SOURCE" -C "$SRC" --strip-components=1 || die "cannot unpack $SOURCE"
fi

# ---- headers and libraries a pip-assembled toolkit may lack (torch's nvidia-* wheels carry them) ---------------
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
  [[ -n "$found" ]] || die "header $h is in neither $CUDA_HOME/include nor torch's nvidia packages"
  [[ " ${EXTRA_INC[*]} " == *" $found "* ]] || EXTRA_INC+=("$found")
done
if [[ ! -e "$CUDA_HOME/include/cccl/cuda/std/utility" && ! -e "$CUDA_HOME/include/cuda/std/utility" ]]; then
  found=""
  for d in "${SEARCH_INC[@]}"; do for c in "$d/cccl" "$d"; do [[ -e "$c/cuda/std/utility" ]] && { found=$c; break 2; }; done; done
  [[ -n "$found" ]] || die "no CCCL headers (cuda/std/utility) under $CUDA_HOME/include or torch's nvidia packages"
  EXTRA_INC+=("$found")
fi
if ((${#EXTRA_INC[@]})); then
  export CPLUS_INCLUDE_PATH="$(IFS=:; echo "${EXTRA_INC[*]}")${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
  say "headers from outside CUDA_HOME: $CPLUS_INCLUDE_PATH"
fi
LINKDIR=$WORK/linklibs
mkdir -p "$LINKDIR"
for lib in cudart nvrtc; do
  found=""
  for d in "${SEARCH_LIB[@]}"; do
    [[ -e "$d/lib$lib.so" ]] && { found="$d/lib$lib.so"; break; }
    cand=$(ls "$d"/lib$lib.so.[0-9]* 2>/dev/null | head -n 1 || true)
    [[ -n "$cand" ]] && { found=$cand; break; }
  done
  [[ -n "$found" ]] || die "lib$lib.so is in neither $CUDA_HOME/lib64 nor torch's nvidia packages"
  [[ "$found" == "$CUDA_HOME/lib64/lib$lib.so" ]] || ln -sf "$found" "$LINKDIR/lib$lib.so"
  # The rpath lets deep_gemm._C find libnvrtc at import without LD_LIBRARY_PATH.
  export LDFLAGS="${LDFLAGS:+$LDFLAGS }-Wl,-rpath,$(dirname "$(readlink -f "$found")")"
done
export LIBRARY_PATH="$LINKDIR${LIBRARY_PATH:+:$LIBRARY_PATH}"
[[ "${DG_STATIC_LIBSTDCXX:-1}" == 1 ]] && export LDFLAGS="$LDFLAGS -static-libstdc++ -Wl,--exclude-libs,ALL"

# ---- source patches (same matches, no std::regex) and the C++ standard ------------------------------------------
if [[ "${DG_PATCH_REGEX:-1}" == 1 ]]; then
  "$PY" "$(dirname "${BASH_SOURCE[0]}")/deep_gemm_no_regex.py" "$SRC" \
    || die "could not patch DeepGEMM's std::regex uses (another DeepGEMM version? set DG_PATCH_REGEX=0)"
  say "patched std::regex uses (include_parser.hpp, compiler.hpp)"
fi
CXX_STD=${DG_CXX_STD:-c++20}
if [[ "$CXX_STD" != c++17 ]]; then
  sed -i "s/'-std=c++17'/'-std=${CXX_STD}'/" "$SRC/setup.py"
  grep -q -- "-std=${CXX_STD}" "$SRC/setup.py" || die "could not set -std=${CXX_STD} in setup.py"
fi

# ---- build --------------------------------------------------------------------------------------------------------
# DG_FORCE_BUILD: never download a prebuilt wheel; DG_USE_LOCAL_VERSION=0: no git calls in setup.py (plain version).
export DG_FORCE_BUILD=1 DG_USE_LOCAL_VERSION=0 DG_SKIP_CUDA_BUILD=0 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
mkdir -p "$WHEEL_DIR" || die "cannot create --wheel-dir $WHEEL_DIR"
LOG=$WHEEL_DIR/deep_gemm_build.log
say "building (log: $LOG)"
( cd "$SRC" && "$PY" -m pip wheel -v --no-index --no-build-isolation --no-deps --no-cache-dir -w "$WHEEL_DIR" . ) >"$LOG" 2>&1 \
  || { grep -nE "error|Error" "$LOG" | tail -n 20 >&2 || true; die "build failed; full log in $LOG"; }
WHEEL=$(ls -t "$WHEEL_DIR"/deep_gemm-*.whl 2>/dev/null | head -n 1)
[[ -n "$WHEEL" ]] || die "pip wheel finished but left no deep_gemm-*.whl in $WHEEL_DIR (log: $LOG)"
say "wheel: $WHEEL"
[[ $INSTALL == 0 && -z "$TARGET" ]] && { say "done: pip install --no-deps $WHEEL"; exit 0; }

# DeepGEMM compiles its kernels at run time with nvcc from CUDA_HOME (else it guesses from `which nvcc`, which a
# wrapper script in /usr/local/bin gets wrong): the environment to run it in is written next to the install.
if [[ -n "$TARGET" ]]; then
  "$PY" -m pip install -q --no-index --no-deps --upgrade --target "$TARGET" "$WHEEL" || die "pip install --target $TARGET failed"
  export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
  ENV_FILE=$TARGET/deep_gemm_env.sh
  mkdir -p "$TARGET"
  {
    echo "# written by examples/scripts/build_deep_gemm.sh: source it before running with the deep_gemm backend"
    echo "export CUDA_HOME='$CUDA_HOME'"
    echo "case \":\${PYTHONPATH:-}:\" in *':$TARGET:'*) ;; *) export PYTHONPATH='$TARGET'\${PYTHONPATH:+:\$PYTHONPATH} ;; esac"
  } > "$ENV_FILE"
  say "installed into $TARGET; run with: source $ENV_FILE"
else
  "$PY" -m pip install -q --no-index --no-deps --force-reinstall "$WHEEL" || die "pip install $WHEEL failed"
  say "installed; run with CUDA_HOME=$CUDA_HOME set (DeepGEMM compiles its kernels with its nvcc)"
fi
[[ $SMOKE == 1 ]] || { say "installed (smoke test skipped)"; exit 0; }
[[ "$HASGPU" == 1 ]] || { say "installed; no GPU here, smoke test skipped"; exit 0; }

# ---- smoke test: fprop (1x128 x 128x128 -> bf16) and wgrad (1x128 x 1x128 -> fp32 into C = D) vs float64 ------------
say "smoke test (the first call JIT-compiles the kernels)"
"$PY" - <<'PYEOF' || die "smoke test failed: DeepGEMM imports but its GEMM is wrong or crashes (see above)"
import sys
import torch
import deep_gemm

if torch.cuda.get_device_capability()[0] != 9:
    sys.exit(f"DeepGEMM's kernels here are sm90's; this GPU is sm{''.join(map(str, torch.cuda.get_device_capability()))}")
g = torch.Generator(device="cuda").manual_seed(0)
M, N, K = 256, 512, 512
mag = lambda r, c: torch.exp(torch.randn(r, c, generator=g, device="cuda"))
x = torch.randn(M, K, generator=g, device="cuda") * mag(M, K // 128).repeat_interleave(128, 1)
w = 0.02 * torch.randn(N, K, generator=g, device="cuda") * mag(N // 128, K // 128).repeat_interleave(128, 0).repeat_interleave(128, 1)

def q_rows(t):  # 1x128 groups
    r, k = t.shape
    s = t.view(r, k // 128, 128).abs().amax(-1).clamp_min(1e-10) / 448.0
    return (t.view(r, k // 128, 128) / s[..., None]).to(torch.float8_e4m3fn).view(r, k), s

def q_tiles(t):  # 128x128 tiles
    n, k = t.shape
    s = t.view(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3)).clamp_min(1e-10) / 448.0
    return (t.view(n // 128, 128, k // 128, 128) / s[:, None, :, None]).to(torch.float8_e4m3fn).view(n, k), s

deq_rows = lambda q, s: (q.double().view(q.shape[0], -1, 128) * s.double()[..., None]).view(q.shape)
deq_tiles = lambda q, s: (q.double().view(s.shape[0], 128, s.shape[1], 128) * s.double()[:, None, :, None]).view(q.shape)
mn_major = lambda s: s.t().contiguous().t()
rel = lambda a, b: float((a.double() - b).norm() / b.norm())
a8, sa = q_rows(x)
b8, sb = q_tiles(w)
d = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
kw = {"disable_ue8m0_cast": True} if "disable_ue8m0_cast" in (deep_gemm.fp8_gemm_nt.__doc__ or "") else {}
deep_gemm.fp8_gemm_nt((a8, mn_major(sa)), (b8, sb.contiguous()), d, **kw)
e1 = rel(d, deq_rows(a8, sa) @ deq_tiles(b8, sb).t())
bw8, sbw = q_rows(w)
d32 = torch.zeros(M, N, dtype=torch.float32, device="cuda")
deep_gemm.fp8_gemm_nt((a8, mn_major(sa)), (bw8, mn_major(sbw)), d32, c=d32, recipe=(1, 1, 128), **kw)
e2 = rel(d32, deq_rows(a8, sa) @ deq_rows(bw8, sbw).t())
# Bounds: bf16 output rounding (2^-8 relative per element) for fprop; fp32 accumulation over K = 512 for wgrad, with
# room for cancellation. A misread scale or layout gives errors of order 1.
print(f"deep_gemm {deep_gemm.__version__}: fprop rel err {e1:.2e} (bf16 output, bound 5e-3), wgrad rel err {e2:.2e} (fp32, bound 1e-3)")
sys.exit(0 if e1 < 5e-3 and e2 < 1e-3 else "relative error above its bound")
PYEOF
say "OK: deep_gemm installed; --precision.gemm_backend auto picks it on sm90"
