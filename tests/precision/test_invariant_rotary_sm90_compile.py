"""The bitwise engine's rotary kernel compiled ahead of time for sm90 on a CPU: no fused multiply-add.

The engine rotates with `kernels.invariant_rotary` while the trainer runs transformers' eager torch, which rounds
`x * cos` and `rotate_half(x) * sin` to bf16 before adding them. A compiler that contracted a product and the sum
into one FMA would skip those roundings on the GPU only (the interpreter test cannot see it). Checked here in the
PTX Triton builds for an H200, with FP fusion on (Triton's default): no `fma` instruction at all, for a fresh
query and for one sliced out of a fused qkv row.

Needs triton with its NVIDIA backend (the CPU wheel has it); skips where triton is missing (the CI venv):
    PYTHONPATH=$PWD python -m pytest -q tests/precision/test_invariant_rotary_sm90_compile.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# A child process: Triton's interpreter (maybe on in this process) and its compiler do not mix.
_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from jetrl_precision.kernels import invariant_rotary as r
out = []
for head, aligned in json.loads(sys.argv[1]):
    fn = r._rotary_kernel
    sig = {"x_ptr": "*bf16", "out_ptr": "*bf16", "pos_ptr": "*i64", "table_ptr": "*bf16", "sx": "i32", "sout": "i32",
           "stab": "i32", "HEAD": "constexpr", "HALF": "constexpr"}
    names = ["x_ptr", "out_ptr", "pos_ptr", "table_ptr"] + (["sx", "sout", "stab"] if aligned else ["out_ptr", "table_ptr"])
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in set(names)}
    k = triton.compile(ASTSource(fn, sig, {"HEAD": head, "HALF": head // 2}, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=1, enable_fp_fusion=True))
    out.append(k.asm["ptx"])
print(json.dumps(out))
"""
JOBS = [[64, True], [64, False], [128, True], [128, False]]


@pytest.fixture(scope="module")
def ptx() -> list[str]:
    triton = pytest.importorskip("triton", reason="triton is not installed (the CI venv)")
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        pytest.skip(f"triton {triton.__version__} cannot compile ahead of time here: {e}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(JOBS)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("job", range(len(JOBS)))
def test_rotary_has_no_fused_multiply_add(ptx, job):
    head, aligned = JOBS[job]
    text = ptx[job]
    assert "mul.f32" in text or "mul.rn.f32" in text, "the kernel's products are missing from the PTX"
    fmas = [line.strip() for line in text.splitlines() if line.strip().startswith("fma")]
    assert not fmas, f"head {head} ({'aligned' if aligned else 'strided'}): {fmas[:3]} contracts a product into the sum"
