"""The row-reduction kernels (log-softmax, RMSNorm) compiled ahead of time for sm90 on a CPU.

The transformers engine hands `invariant_log_probs` the fp32 logits that `generate` returns; the trainer hands it
its model's bf16 logits, the same values. Triton gives the two launches other register layouts: the loads are
vectorized to 16 bytes, so a bf16 row gets 8 elements per thread and an fp32 row 4 (and an unaligned view 1). A
`tl.sum` over such a row adds in an order that follows the layout, so the two would differ in the last bit of the
logsumexp; the interpreter (numpy) has no layouts and cannot show it. What is checked here, in the TTGIR Triton
builds for an H200 with a real launch's specializations: no addition reduction of the kernels spans more than
two elements (a sum of two values commutes exactly), whatever the input dtype and alignment; the row's sum is a
fixed pairwise tree of element-wise additions instead (`kernels._tree.pairwise_sum`). The RMSNorm kernel gets the
same check: the engine and the trainer normally hand it fresh bf16 rows, but a view (vLLM's static CUDA-graph
buffers, a strided slice) must not change its sum either.

Needs triton with its NVIDIA backend (the CPU wheel has it); skips where triton is missing (the CI venv):
    PYTHONPATH=$PWD python -m pytest -q tests/precision/test_invariant_reductions_sm90_compile.py
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# A child process: Triton's interpreter (the interpreter tests, maybe in this process) and its compiler do not mix.
_COMPILE = """
import json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from jetrl_precision.kernels import invariant_norm, invariant_softmax
modules = {"softmax": invariant_softmax, "norm": invariant_norm}
out = []
for module, kernel, ptrs, scalars, aligned, consts in json.loads(sys.argv[1]):
    mod = modules[module]
    fn = getattr(mod, kernel)
    consts = {k: getattr(tl, v[3:]) if isinstance(v, str) and v.startswith("tl.") else v for k, v in consts.items()}
    sig = {n: ptrs.get(n) or scalars.get(n, "constexpr") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    k = triton.compile(ASTSource(fn, sig, consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=mod.NUM_WARPS))
    out.append(k.asm["ttgir"])
print(json.dumps(out))
"""

VOCAB_BLOCK, HIDDEN_BLOCK = 4096, 1024  # the modules' constants (checked below against the modules where triton imports)
# kernel: (module, pointer args (x_ptr's dtype filled per job), scalar args, constexprs, the row block)
KERNELS = {
    "_logprob_kernel": ("softmax", {"label_ptr": "*i64", "out_ptr": "*fp32", "lse_ptr": "*fp32"},
                        {"V": "i32", "sx": "i32", "temperature": "fp32"}, {"BLOCK": VOCAB_BLOCK}, VOCAB_BLOCK),
    "_log_softmax_kernel": ("softmax", {"out_ptr": "*fp32"}, {"V": "i32", "sx": "i32", "so": "i32", "temperature": "fp32"},
                            {"BLOCK": VOCAB_BLOCK}, VOCAB_BLOCK),
    "_rms_norm_kernel": ("norm", {"res_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "res_out_ptr": "*bf16"},
                         {"H": "i32", "h_f": "fp32", "eps": "fp32", "sx": "i32", "sres": "i32", "sy": "i32", "sres_out": "i32"},
                         {"BLOCK": HIDDEN_BLOCK, "HAS_RES": True, "X_DTYPE": "tl.bfloat16", "Y_DTYPE": "tl.bfloat16"}, HIDDEN_BLOCK),
}
DTYPES = {"softmax": ["bf16", "fp16", "fp32"], "norm": ["bf16"]}


def _jobs() -> list:
    """Each kernel and input dtype, launched on a fresh tensor (16-byte aligned, sizes % 16 == 0, what the engine and
    trainer pass) and on a view at an odd offset with odd sizes (no vectorized loads)."""
    jobs = []
    for kernel, (module, ptrs, scalars, consts, _) in KERNELS.items():
        for dt in DTYPES[module]:
            for aligned in (True, False):
                divisible = [*ptrs, *(["x_ptr", *(n for n, t in scalars.items() if t == "i32")] if aligned else [])]
                jobs.append([module, kernel, {**ptrs, "x_ptr": f"*{dt}"}, scalars, divisible, consts])
    return jobs


@pytest.fixture(scope="module")
def ttgir() -> dict:
    triton = pytest.importorskip("triton", reason="triton is not installed (the CI venv)")
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        pytest.skip(f"triton {triton.__version__} cannot compile ahead of time here: {e}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = str(ROOT)
    jobs = _jobs()
    r = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(jobs)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return {(k, ptrs["x_ptr"], "aligned" if "x_ptr" in al else "unaligned"): t for (_, k, ptrs, _, al, _), t in zip(jobs, out)}


_REDUCE = re.compile(r'"tt\.reduce"\(.*?<\{axis = (\d+) : i32\}> \(\{(.*?)\}\) : \(tensor<([0-9x]+)x\w+', re.S)


def _reductions(ttgir: str) -> list[tuple[str, int]]:
    """(combiner ops, length of the reduced axis) of every tt.reduce."""
    out = []
    for axis, body, shape in _REDUCE.findall(ttgir):
        ops = ",".join(sorted(set(re.findall(r"= (arith\.\w+)", body))))
        out.append((ops, int(shape.split("x")[int(axis)])))
    return out


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_no_sum_follows_the_register_layout(ttgir, kernel):
    block = KERNELS[kernel][-1]
    for (name, dt, al), text in ttgir.items():
        if name != kernel:
            continue
        reds = _reductions(text)
        wide = [(ops, n) for ops, n in reds if "arith.addf" in ops and n > 2]
        assert not wide, (f"{kernel}, {dt} input ({al}): a sum over {wide[0][1]} elements, whose order follows the "
                          "register layout Triton picks from the dtype and alignment; sum in a fixed tree instead")
        # the row's sum is the pairwise tree: element-wise additions of halving width down to one element
        widths = [int(w) for w in re.findall(r"arith\.addf [^\n]*: tensor<(\d+)xf32", text)]
        tree = [2**i for i in range(block.bit_length() - 2, -1, -1)]
        assert [w for w in widths if w < block] == tree, f"{kernel} {dt} {al}: {widths}"


def test_the_blocks_checked_are_the_modules():
    pytest.importorskip("triton", reason="triton is not installed (the CI venv)")
    from jetrl_precision.kernels import invariant_norm, invariant_softmax

    assert (invariant_softmax.VOCAB_BLOCK, invariant_norm.HIDDEN_BLOCK) == (VOCAB_BLOCK, HIDDEN_BLOCK)
