"""Where a timed call's GPU time goes, by kernel group, and what that leaves FP8 to gain (`--kernel-split`).

FP8 replaces the linear layers' GEMMs (plus quantizers) and nothing else: attention, norms, RoPE, residual adds,
copies and the optimizer keep their BF16 cost. So the kernels a BF16 step spends outside its GEMMs bound the FP8
speed-up whatever the FP8 GEMMs do. `ceiling` works that bound out from two measured splits.
"""

from __future__ import annotations

import math

__all__ = ["GEMM_FP8", "GEMM_BF16", "QUANTIZE", "FP8_PEAK_GAIN", "kernel_split", "ceiling", "ceiling_line"]

GEMM_FP8, GEMM_BF16, QUANTIZE = "gemm fp8", "gemm bf16", "quantize"


def kernel_split(fn, calls: int = 2, top: int = 12) -> tuple[dict[str, float], list[tuple[str, float, str]]]:
    """(ms per call of `fn` on the GPU by kernel group (update_profile.KERNEL_GROUPS), the `top` kernels outside
    the GEMMs as (name, ms per call, group)), from torch.profiler over `calls` calls after one unprofiled call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from openrlhf.utils.profiling import kernel_times
    from update_profile import kernel_group  # benchmarks/ is on sys.path: gpu_bench runs as a script from there

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    groups: dict[str, float] = {}
    rest = []
    for name, us in kernel_times(prof, True).items():
        g = kernel_group(name)
        groups[g] = groups.get(g, 0.0) + us / 1e3 / calls
        if g not in (GEMM_FP8, GEMM_BF16):
            rest.append((name, us / 1e3 / calls, g))
    rest.sort(key=lambda k: -k[1])
    return dict(sorted(groups.items(), key=lambda kv: -kv[1])), rest[:top]


# Hopper's dense FP8 tensor-core peak over its BF16 peak (H100 SXM and H200: 1,979 against 989 TFLOP/s).
FP8_PEAK_GAIN = 2.0


def ceiling(bf16: dict[str, float], fp8: dict[str, float], goal: float | None = None,
            peak_gain: float = FP8_PEAK_GAIN) -> dict[str, float]:
    """From the BF16 and FP8 kernel splits of one call (ms per group):

    - `fp8_rest_ms`: the FP8 call's kernels other than its FP8 GEMMs and quantizers (all that FP8 leaves as is);
    - `ceiling`: BF16's kernel time over that rest, the ratio if the FP8 GEMMs and quantizers took no time;
    - `at_peak`: the ratio if the FP8 GEMMs ran `peak_gain` times as fast as the BF16 ones they replace and the
      quantizers took no time: the most FP8 GEMMs can give this call;
    - `gemm_gain`: BF16's GEMM time over the FP8 GEMMs' plus quantizers' time, what the FP8 part achieves now;
    - `gemm_gain_needed` (with `goal`): the gain the FP8 part would need for the call to reach `goal`
      (inf where the rest alone is over the goal's budget)."""
    bf_total, fp_total = sum(bf16.values()), sum(fp8.values())
    fp8_part = fp8.get(GEMM_FP8, 0.0) + fp8.get(QUANTIZE, 0.0)
    rest = fp_total - fp8_part
    # The BF16 GEMMs that FP8 replaced: BF16's GEMM time less those the FP8 call still runs in BF16 (lm_head, say).
    replaced = bf16.get(GEMM_BF16, 0.0) - fp8.get(GEMM_BF16, 0.0)
    out = {"bf16_kernel_ms": bf_total, "fp8_kernel_ms": fp_total, "fp8_rest_ms": rest,
           "bf16_gemm_share": bf16.get(GEMM_BF16, 0.0) / bf_total if bf_total else 0.0,
           "kernel_ratio": bf_total / fp_total if fp_total else math.inf,
           "ceiling": bf_total / rest if rest > 0 else math.inf,
           "at_peak": bf_total / (rest + replaced / peak_gain) if rest + replaced > 0 else math.inf,
           "gemm_gain": replaced / fp8_part if fp8_part > 0 else math.inf}
    if goal:
        budget = bf_total / goal - rest
        out["goal"] = goal
        out["gemm_gain_needed"] = replaced / budget if budget > 0 else math.inf
    return out


def ceiling_line(label: str, c: dict[str, float]) -> str:
    need = ""
    if "goal" in c:
        need = (f"; {c['goal']:.2f}x would need the FP8 GEMMs+quantizers at "
                + ("(unreachable: the rest alone is over budget)" if math.isinf(c["gemm_gain_needed"])
                   else f"{c['gemm_gain_needed']:.2f}x BF16's GEMMs"))
    return (f"  {label:22s} kernels {c['fp8_kernel_ms']:8.2f} ms ({c['kernel_ratio']:.3f}x BF16's "
            f"{c['bf16_kernel_ms']:.2f}); GEMMs {100 * c['bf16_gemm_share']:.0f}% of BF16's kernels; FP8 GEMMs+quantizers "
            f"{c['gemm_gain']:.2f}x BF16's GEMMs; the rest {c['fp8_rest_ms']:.2f} ms caps the call at "
            f"{c['ceiling']:.2f}x, and at {c['at_peak']:.2f}x with FP8 GEMMs at {FP8_PEAK_GAIN:g}x BF16's{need}")
