"""The batch-invariant GEMM kernels compiled ahead of time for sm90 (H100/H200) on a CPU-only machine.

Needs triton with its NVIDIA backend (ptxas ships in the wheel); the CI venv has no triton, so these tests skip
there (importorskip). Run them with a venv that has CPU torch and triton:

    PYTHONPATH=$PWD python -m pytest -q tests/precision/test_invariant_gemm_sm90_compile.py

No GPU is needed: `triton.compile` (in a child process) lowers to PTX and assembles a cubin for sm90. Checked, with the argument
specializations a real launch gets (16-byte-aligned pointers, K-contiguous operands, K and N multiples of 16):
- every kernel compiles, and the FP8 dot is one Hopper wgmma whose N is the M tile (m64n{BLOCK_M}k32, e4m3):
  the instruction shape follows the M tile, which may follow M's bucket because it does not change the bits
  (tests/gpu/test_invariant_gemm_gpu.py checks that on the device);
- the operand tiles are copied asynchronously (cp.async): the K loop is software-pipelined, not serial loads.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Runs in a child process: Triton's interpreter (the interpreter tests, possibly in this process) and its compiler
# do not mix within one process.
_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from jetrl_precision.kernels import invariant_gemm as mod
jobs = json.loads(sys.argv[1])
out = []
for kernel, ptrs, const, divisible, warps, stages in jobs:
    fn = getattr(mod, kernel)
    names = fn.arg_names
    sig = {n: ptrs.get(n, "constexpr" if n in const else "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in [*ptrs, *divisible]}
    k = triton.compile(ASTSource(fn, sig, const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages))
    out.append(k.asm["ptx"])
print(json.dumps(out))
"""


def _compile(jobs: list) -> list[str]:
    """PTX of each (kernel name, pointer types, constexprs, args divisible by 16, warps, stages), for sm90."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(jobs)], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def compiled():
    triton = pytest.importorskip("triton", reason="triton is not installed (the CI venv)")
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        pytest.skip(f"triton {triton.__version__} cannot compile ahead of time here: {e}")
    return _compile


FP8_PTRS = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "sb_ptr": "*fp32", "c_ptr": "*bf16"}


@pytest.mark.parametrize("block_n,block_m,warps,stages,b_block,even_k", [
    (64, 64, 4, 4, 128, True),   # the default configuration
    (64, 16, 4, 3, 128, False),  # a narrow M tile, a partial last K group (SmolLM2's K = 576)
    (128, 32, 8, 4, 1, True),    # 1x128-scaled B (WGrad's operand)
])
def test_fp8_kernel_is_one_wgmma_per_k_step_with_n_the_m_tile(compiled, block_n, block_m, warps, stages, b_block, even_k):
    const = dict(B_BLOCK_N=b_block, EVEN_K=even_k, BLOCK_N=block_n, BLOCK_M=block_m, NUM_STAGES=stages,
                 EMULATE_MMA=False, s_ak=1, s_bk=1, s_cn=1, s_sbg=1)
    if b_block == 128:
        const["s_sam"] = 1
    (ptx,) = compiled([("_fp8_kernel", FP8_PTRS, const, ["K", "N", "s_am", "s_bn", "s_cm", "s_sbn"], warps, stages)])
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.e4m3\.e4m3", ptx)) == {f"m64n{block_m}k32"}
    assert "mma.sync" not in ptx, "no fallback to Ampere-style MMAs"
    assert "cp.async" in ptx, "the weight and activation tiles must be prefetched asynchronously"


def test_bf16_and_split_sum_kernels_compile(compiled):
    # invariant_config(128256, 4096, bf16), the lm_head's: a 64 x 64 tile, 64-wide K steps, 4 warps, 4 stages.
    const = dict(EVEN_K=True, BLOCK_N=64, BLOCK_M=64, BLOCK_K=64, NUM_STAGES=4, EMULATE_MMA=False, s_ak=1, s_bk=1, s_cn=1)
    bf16, split_sum = compiled([
        ("_bf16_kernel", {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16"}, const, ["K", "N", "s_am", "s_bn", "s_cm"], 4, 4),
        ("_sum_splits_kernel", {"ws_ptr": "*fp32", "c_ptr": "*bf16"}, dict(SPLIT=4, BLOCK=1024), [], 4, 1),
    ])
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.bf16\.bf16", bf16)) == {"m64n64k16"}
    assert "ld.global" in split_sum
