#!/usr/bin/env bash
# Everything GPU in one device call: DeepGEMM (when its archive travels), the GPU tests, the benchmark.
#
#   run(command="bash benchmarks/gpu_all.sh", carry=[".dg"])        # .dg from benchmarks/deep_gemm_pack.sh
#
# Knobs: SECTIONS (gpu_bench sections, default all), PYTEST_K (a -k filter; PYTEST_K=skip runs no tests),
# BENCH_TIMEOUT / TEST_TIMEOUT in seconds. On a fresh machine the whole of tests/gpu takes longer than one call allows
# next to the benchmark (test_triton_quant.py alone spends minutes on Triton compiles and reference checks, the
# linear tests on DeepGEMM's JIT): split it, e.g. PYTEST_K=skip here and the tests in a call of their own.
# Writes 4 files to $OUT, well under what a device call returns:
# deep_gemm_build.txt, pytest.txt, gpu_bench.log and gpu_bench.json.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-.}
date -u
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader || true

if [[ -f .dg/deepgemm-src.tar.gz ]]; then
  # About 95 s on a fresh machine; the deep_gemm backend (and `auto`) use it from here on.
  if bash benchmarks/deep_gemm_device.sh > "$OUT/deep_gemm_build.txt" 2>&1; then
    source /tmp/dg_env.sh
    echo "deep_gemm: built and smoke-tested"
  else
    echo "deep_gemm: build or smoke test FAILED (see deep_gemm_build.txt); continuing without it"
    tail -n 5 "$OUT/deep_gemm_build.txt"
  fi
else
  echo "deep_gemm: no .dg/deepgemm-src.tar.gz carried; running without it"
fi

if [[ "${PYTEST_K:-}" != skip ]]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rfs tests/gpu ${PYTEST_K:+-k "$PYTEST_K"} \
    > "$OUT/pytest.txt" 2>&1
  echo "pytest rc=$?"; grep -E "passed|failed|FAILED|SKIPPED" "$OUT/pytest.txt" | tail -n 12
fi

SECTIONS=${SECTIONS:-env,copy,quant,host,gemm,linear,stack,decode}
PYTHONUNBUFFERED=1 timeout "${BENCH_TIMEOUT:-400}" python3 benchmarks/gpu_bench.py --sections "$SECTIONS" \
  --stack-backends auto,torch --out "$OUT/gpu_bench.json" > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench rc=$?"
grep -E "geomean|tok/s|section|errors|rror|^\| " "$OUT/gpu_bench.log" | grep -v -i warn | tail -n 52
