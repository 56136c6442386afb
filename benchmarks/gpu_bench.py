"""All GPU benchmarks of the FP8 path in one run; prints one table and writes JSON records.

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_bench.py --out $OUT/gpu_bench.json [--sections env,quant,...]

Sections (each guarded, so one failure does not lose the rest; one module each in `gpu_sections/`):
  env       GPU, clocks, software versions
  copy      device-to-device copy bandwidth (the memory ceiling)
  quant     every Triton quantizer: bandwidth vs copy, plus plain-torch reference quantizer
  host      host time per call at decode size, and where an Fp8Linear step's host time goes
  gemm      TFLOP/s per backend at Llama-3.1-8B shapes x M, BF16 F.linear in the same run, correctness
  linear    FP8 linear fwd+bwd vs nn.Linear BF16 at M=8192, kernel breakdown, saved-activation bytes
  stack     4-layer Llama-3.1-8B-shaped decoder: fwd+bwd+AdamW step, tokens/s and peak memory
  reference the same stack's forward under no_grad at 16K and 32K tokens (the reference / old-logprob pass)
  decode    the same stack's forward at M=64 and 256 tokens (one position each), eager and CUDA graph
  layers    decoder layers at a GRPO micro-batch's token counts: stacked q/k/v + gate/up GEMMs against separate
            ones and BF16 (fwd+bwd, no-grad forward, host time per layer); not in the default sections
`--kernel-split`: stack and reference also profile each variant's GPU time by kernel group and print the ratio the
kernels FP8 leaves in BF16 (attention, norms, copies, the optimizer) cap it at (`gpu_sections/kernel_split.py`).
Timing (`gpu_sections/timing.py`): triton.testing.do_bench medians (L2 flushed before each repeat); ratios are
within this run. The GEMM section times each GEMM at the power cap instead (`bench_sustained`: a CUDA graph of
back-to-back calls after a warm-up, BF16 and FP8 alternating), with the SM clock and power beside each figure and
do_bench's kept as `flush_tflops`. `gpu_report.py` turns the JSON into result records, tables and plots.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jetrl_precision.kernels.layout import padding_events  # noqa: E402
from gpu_sections import timing  # noqa: E402  (benchmarks/ is on sys.path: this file runs as a script from there)
from gpu_sections.env import section_copy, section_env  # noqa: E402
from gpu_sections.gemm import section_gemm  # noqa: E402
from gpu_sections.host import section_host  # noqa: E402
from gpu_sections.layers import section_layers  # noqa: E402
from gpu_sections.linear import section_linear  # noqa: E402
from gpu_sections.quant import section_quant  # noqa: E402
from gpu_sections.stack import section_decode, section_reference, section_stack  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_bench.json"))
    ap.add_argument("--sections", default="env,copy,quant,host,gemm,linear,stack,reference,decode")
    ap.add_argument("--stack-batch", type=int, default=16)
    ap.add_argument("--stack-steps", type=int, default=4)
    ap.add_argument("--stack-backends", default="auto", help="GEMM backends of the jet_fp8 stack/decode variants, e.g. auto,torch")
    ap.add_argument("--gemm-backends", default="torch,triton,deep_gemm", help="backends timed in the gemm section (if available)")
    ap.add_argument("--linear-backends", default="auto,torch,triton",
                    help="backends of the linear section (auto first, then those present that auto is not)")
    ap.add_argument("--layer-tokens", default="4352,16384",
                    help="token counts of the layers section (4352: a GRPO micro-batch of 4 x (64 + 1024) tokens)")
    ap.add_argument("--kernel-split", action="store_true",
                    help="stack and reference: also profile each variant's GPU time by kernel group, and what the kernels "
                         "FP8 leaves in BF16 cap its ratio at (gpu_sections/kernel_split.py)")
    ap.add_argument("--reference-batches", default="4,8", type=lambda s: [int(v) for v in s.split(",")],
                    help="batches of 4096 tokens the reference section's forward takes")
    args = ap.parse_args()
    timing.set_command(
        "PYTHONUNBUFFERED=1 python3 benchmarks/gpu_bench.py " + " ".join(sys.argv[1:]).replace(os.environ.get("OUT", "\0"), "$OUT")
    )
    t_start = time.time()
    copy_bw = None  # TB/s of this device's copy, which the quantizers' "% of copy" divides by
    env = {}
    errors = {}
    for sec in args.sections.split(","):
        t0 = time.time()
        try:
            if sec == "env":
                env = section_env(args)
            elif sec == "copy":
                copy_bw = section_copy(args)
            elif sec == "quant":
                if copy_bw is None:  # never another card's copy (a fixed H200 figure made an H100's quantizers read 65%)
                    copy_bw = section_copy(args)
                section_quant(args, copy_bw)
            elif sec == "gemm":
                section_gemm(args)
            elif sec == "host":
                section_host(args)
            elif sec == "linear":
                section_linear(args)
            elif sec == "stack":
                section_stack(args)
            elif sec == "decode":
                section_decode(args)
            elif sec == "reference":
                section_reference(args)
            elif sec == "layers":
                section_layers(args)
            else:
                raise ValueError(f"unknown section {sec!r}")
        except Exception as e:  # noqa: BLE001 - keep going, record the failure
            errors[sec] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        torch.cuda.empty_cache()
        print(f"[section {sec}: {time.time() - t0:.1f} s]", flush=True)
        with open(args.out, "w") as f:
            json.dump({"env": env, "errors": errors, "padding_events": padding_events, "records": timing.RECORDS,
                       "elapsed_s": time.time() - t_start}, f, indent=1, default=str)
    from gpu_report import targets_table  # benchmarks/ is on sys.path: this file runs as a script from there

    print("\nThe goals, from this run:\n" + targets_table(timing.RECORDS))
    print(f"done in {time.time() - t_start:.0f} s; errors: {errors or 'none'}; wrote {args.out}")


if __name__ == "__main__":
    main()
