#!/usr/bin/env bash
# Pack DeepGEMM's source with its CUTLASS and fmt submodule pins into .dg/deepgemm-src.tar.gz, the archive
# benchmarks/deep_gemm_device.sh builds from on the (offline) H200. Run it here, where git works:
#
#   benchmarks/deep_gemm_pack.sh DEEPGEMM_GIT CUTLASS_GIT FMT_GIT [COMMIT]
#
# Each *_GIT is a git directory holding that repository (a bare clone, e.g. `git clone --bare
# https://github.com/deepseek-ai/DeepGEMM`). COMMIT defaults to 54e22612 (DeepGEMM 2.6.1, the version
# measured on the H200); the CUTLASS and fmt commits are read from its submodule entries. Only what the
# build and the runtime JIT read goes in: setup.py, csrc/, deep_gemm/, scripts/generate_pyi.py and the
# two libraries' include/ trees (about 2.5 MiB compressed). `.dg/` must be git-ignored (.git/info/exclude).
set -euo pipefail

die() { echo "deep_gemm_pack: ERROR: $*" >&2; exit 1; }
[[ $# -ge 3 ]] || die "usage: $0 DEEPGEMM_GIT CUTLASS_GIT FMT_GIT [COMMIT]"
DG=$1 CUTLASS=$2 FMT=$3 COMMIT=${4:-54e22612409371d6364144b69086735beb54e98b}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUTF=$REPO/.dg/deepgemm-src.tar.gz

git --git-dir="$DG" cat-file -e "$COMMIT^{commit}" 2>/dev/null || die "$DG has no commit $COMMIT"
pin() {  # the commit a submodule path points at in DeepGEMM's tree
  git --git-dir="$DG" ls-tree "$COMMIT" "$1" | awk '$2 == "commit" {print $3}'
}
CUT_PIN=$(pin third-party/cutlass) FMT_PIN=$(pin third-party/fmt)
[[ -n "$CUT_PIN" && -n "$FMT_PIN" ]] || die "no submodule pins for third-party/cutlass and third-party/fmt at $COMMIT"
git --git-dir="$CUTLASS" cat-file -e "$CUT_PIN^{commit}" 2>/dev/null || die "$CUTLASS lacks the pinned commit $CUT_PIN"
git --git-dir="$FMT" cat-file -e "$FMT_PIN^{commit}" 2>/dev/null || die "$FMT lacks the pinned commit $FMT_PIN"

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
TOP=$WORK/deepgemm-src
mkdir -p "$TOP/third-party/cutlass" "$TOP/third-party/fmt"
git --git-dir="$DG" archive "$COMMIT" setup.py LICENSE README.md scripts/generate_pyi.py csrc deep_gemm | tar -x -C "$TOP"
# (A partial mirror may print "invalid object" for blobs outside these paths; the exit status is what counts.)
git --git-dir="$CUTLASS" archive "$CUT_PIN" include LICENSE.txt | tar -x -C "$TOP/third-party/cutlass"
git --git-dir="$FMT" archive "$FMT_PIN" include LICENSE | tar -x -C "$TOP/third-party/fmt"
{
  echo "DeepGEMM source for an offline build, packed by benchmarks/deep_gemm_pack.sh (not the upstream tarball)."
  echo "deepseek-ai/DeepGEMM $COMMIT ($(git --git-dir="$DG" log -1 --format=%ci "$COMMIT"))"
  echo "  kept: setup.py LICENSE README.md scripts/generate_pyi.py csrc/ deep_gemm/"
  echo "third-party/cutlass = NVIDIA/cutlass $CUT_PIN (submodule pin; include/ and LICENSE.txt only)"
  echo "third-party/fmt     = fmtlib/fmt $FMT_PIN (submodule pin; include/ and LICENSE only)"
} > "$TOP/DG_SOURCE.txt"
mkdir -p "$(dirname "$OUTF")"
tar -czf "$OUTF" -C "$WORK" deepgemm-src
echo "wrote $OUTF ($(du -h "$OUTF" | cut -f1)); carry .dg in the device call and run benchmarks/deep_gemm_device.sh"
