"""Static SASS instruction counts of the shipped quantizer kernels, compiled for sm_90a on a machine without a GPU.

Triton's wheel carries ptxas and nvdisasm, so a CPU machine can compile a kernel for Hopper and count what it
became. The count is static (every instruction once, the division slow path and setup included), divided by the
elements one thread handles: a way to compare kernel variants before spending device time, not a timing.

    python3 -m venv /tmp/trvenv && /tmp/trvenv/bin/pip install triton==3.6.0
    PYTHONPATH=.venv/lib/python3.11/site-packages /tmp/trvenv/bin/python benchmarks/sass_count.py [--dump KIND]

The CUDA requantizer (`kernels/cast_transpose.py`, row `cudaT`) is compiled with NVRTC from the
`nvidia-cuda-nvrtc-cu12` wheel and the same ptxas. Take NVRTC 12.8, as old as Triton 3.6's ptxas (12.9 writes PTX
8.8, which that ptxas refuses): `/tmp/trvenv/bin/pip install nvidia-cuda-nvrtc-cu12==12.8.93`. Without the wheel
that row says so and the others still print. Its count holds both the interior and the edge-tile load paths, of
which a tile runs one; the disassembly (`nvdisasm -c`) shows how many an interior tile runs per element.

(torch comes from the project's venv only for the imports; nothing runs on a device.) Integer arguments get
Triton's run-time specialization by hand: strides of 1 are constants and every other pointer and integer is marked
divisible by 16, as on the H200 for 128-multiple shapes. Without those hints the layouts come out unvectorized and
the counts mean nothing.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import glob
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jetrl_precision.kernels import cast_transpose, quant  # noqa: E402

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_INSTR = re.compile(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def compile_sass(kernel, signature: dict, constants: dict, num_warps: int) -> list[str]:
    """The kernel's SASS opcodes for sm_90a, one per instruction."""
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]]
             for n, t in signature.items() if t != "constexpr" and n not in constants}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    return _disassemble(compiled.asm["cubin"])


def _disassemble(cubin: bytes) -> list[str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([os.path.join(_BIN, "nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
    return [m.group(1) for line in text.splitlines() if (m := _INSTR.match(line))]


def _nvrtc() -> ctypes.CDLL:
    import nvidia.cuda_nvrtc  # the nvidia-cuda-nvrtc-cu12 wheel (a namespace package)

    libs = [p for d in nvidia.cuda_nvrtc.__path__ for p in glob.glob(os.path.join(d, "lib", "libnvrtc.so*")) if "alt" not in p]
    if not libs:
        raise ImportError("nvidia-cuda-nvrtc-cu12 has no libnvrtc.so")
    return ctypes.CDLL(sorted(libs)[0])


def compile_cuda_sass(source: str, name: str) -> list[str]:
    """A CUDA C++ kernel's SASS opcodes for sm_90a: NVRTC to PTX, then Triton's ptxas and nvdisasm."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"k.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    lib.nvrtcAddNameExpression(prog, name.encode())
    opts = [b"--gpu-architecture=compute_90a", b"-std=c++17"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    if rc:
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"NVRTC failed:\n{log.value.decode()}")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        Path(src).write_bytes(ptx.value)
        subprocess.run([os.path.join(_BIN, "ptxas"), "-arch=sm_90a", src, "-o", out], check=True)
        return _disassemble(Path(out).read_bytes())


def _sig(pointers: dict, ints: list[str], constexprs: list[str]) -> dict:
    return {**pointers, **{n: "i32" for n in ints}, **{n: "constexpr" for n in constexprs}}


def kernels() -> dict:
    """name -> (kernel, signature, constants, num_warps, elements per thread) at the shipped launch shapes."""
    ints_128x1 = ["R", "C", "sxr", "sxc", "sir", "sig", "sqr", "sqc", "ssb", "ssc"]
    flags_128x1 = ["BLOCK_C", "POW2", "DEQ", "COL_FASTEST"]

    def k128x1(in_dtype: str, tile: quant.Tile128x1, deq: bool):
        sig = _sig({"x_ptr": in_dtype, "in_s_ptr": "*fp32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}, ints_128x1, flags_128x1)
        # Written transposed: the input's and the output's fastest strides (and the scales') are 1.
        const = {"BLOCK_C": tile.block_c, "POW2": False, "DEQ": deq, "COL_FASTEST": tile.col_fastest,
                 "sxc": 1, "sqr": 1, "ssc": 1, **({"sir": 1} if deq else {})}
        return quant._quant_128x1_kernel, sig, const, tile.num_warps, 128 * tile.block_c // (32 * tile.num_warps)

    sig_1x128 = _sig({"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
                     ["R", "C", "sxr", "sxc", "sqr", "sqc", "ssr", "ssg"], ["BLOCK_R", "POW2"])
    sig_128x128 = _sig({"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qt_ptr": "*fp8e4nv", "s_ptr": "*fp32", "st_ptr": "*fp32"},
                       ["R", "C", "sxr", "sxc", "sqr", "sqc", "stqr", "stqc", "ssr", "ssc", "stsr", "stsc"],
                       ["POW2", "WRITE_Q", "WRITE_T"])
    return {
        "1x128": (quant._quant_1x128_kernel, sig_1x128, {"BLOCK_R": 32, "POW2": False, "sxc": 1, "sqc": 1, "ssr": 1}, 4, 32 * 128 // 128),
        "128x1T": k128x1("*bf16", quant.TILE_128x1_T, False),
        "requantT": k128x1("*fp8e4nv", quant.TILE_REQUANT_T, True),
        "128x128": (quant._quant_128x128_kernel, sig_128x128,
                    {"POW2": False, "WRITE_Q": True, "WRITE_T": False, "sxc": 1, "sqc": 1, "ssc": 1}, 4, 128 * 128 // 128),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump", default=None, help="also print the opcode histogram of this kernel in full")
    args = ap.parse_args()
    print(f"{'kernel':10s} {'warps':>5s} {'elem/thread':>11s} {'SASS instr':>10s} {'per element':>11s}  top opcodes")
    rows = list(kernels().items()) + [("cudaT", None)]
    for name, spec in rows:
        if spec is None:  # the CUDA requantizer: 4 warps, 32 tokens x 4 columns per thread
            warps, per_thread = 4, 128
            try:
                ops = compile_cuda_sass(cast_transpose._SOURCE, "requant_1x128_to_128x1_t<false>")
            except ImportError as e:
                print(f"{name:10s} skipped: no NVRTC here ({e}); pip install nvidia-cuda-nvrtc-cu12==12.8.93")
                continue
        else:
            kernel, sig, const, warps, per_thread = spec
            ops = compile_sass(kernel, sig, const, warps)
        hist = collections.Counter(op.split(".")[0] for op in ops if op != "NOP")
        n = sum(hist.values())
        top = ", ".join(f"{k} {v}" for k, v in hist.most_common(6))
        print(f"{name:10s} {warps:5d} {per_thread:11d} {n:10d} {n / per_thread:11.1f}  {top}")
        if args.dump == name:
            print("   ", dict(hist.most_common()))


if __name__ == "__main__":
    main()
