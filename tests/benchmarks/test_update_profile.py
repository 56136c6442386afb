"""benchmarks/update_profile.py on CPU (`--tiny`): the actor update's micro-step runs for bf16 and jet_fp8 under the
trainer's DeepSpeed strategy (gloo), and jet_fp8 under plain autograd with re-quantized weights; the profiles
become a table and a run record.

The H200 profiles (`bash benchmarks/h200_grpo.sh update_profile`) go through the same code; only the sizes, the
device and the kernels the profiler sees differ.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import update_profile  # noqa: E402
from _rl_helpers import ENV  # noqa: E402


@pytest.mark.parametrize("name, group", [
    ("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_coopA_algo2_Ablk128_Bvec128_TNN", "gemm fp8"),
    ("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT", "gemm bf16"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1_cga1x1x1_kernel0", "attention"),
    ("_quant_1x128_kernel", "quantize"),
    ("_silu_mul_quant_kernel", "quantize"),
    ("requant_1x128_to_128x1_t", "quantize"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3> >", "elementwise"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)", "copy/fill"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>", "log-softmax"),
    ("void multi_tensor_apply_kernel<at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4>>", "optimizer"),
])
def test_kernel_groups_name_the_h200_kernels(name, group):
    assert update_profile.kernel_group(name) == group


def test_table_has_a_ratio_column_per_fp8_recipe():
    """An A/B (jet_fp8 against jet_fp8+plainnorm) reads each FP8 recipe against bf16, not the last one against bf16."""
    def job(recipe, wall, quant):
        return {"recipe": recipe, "layers": 8, "prompt_len": 256, "new_tokens": 1024, "gemm_backend": "torch",
                "variant": "deepspeed", "micro": 4, "grad_ckpt": False, "micro_step_wall_ms": wall,
                "micro_step_kernel_ms": wall - 5, "groups_ms": {"quantize": quant, "elementwise": wall - 5 - quant},
                "fwd_micro": 8, "fwd_nograd_ms": wall / 2, "peak_allocated_gib": 30.0, "kernels_captured": 10,
                "top_kernels_us": []}

    table = update_profile.summarize([job("bf16", 180.0, 0.0), job("jet_fp8", 144.0, 7.0), job("jet_fp8+plainnorm", 160.0, 6.5)])
    assert "| ms | bf16 | jet_fp8 | jet_fp8+plainnorm | bf16 / jet_fp8 | bf16 / jet_fp8+plainnorm |" in table
    assert "| micro-step wall | 180.0 | 144.0 | 160.0 | 1.250 | 1.125 |" in table
    assert "|   quantize | 0.0 | 7.0 | 6.5 | - | - |" in table  # nothing to compare where bf16 has none


@pytest.mark.slow
@pytest.mark.integration
def test_tiny_profiles_run_and_file_a_record(tmp_path):
    out = tmp_path / "prof"
    proc = subprocess.run(
        [sys.executable, "benchmarks/update_profile.py", "--tiny", "--layers", "2", "--prompt-len", "16", "--new-tokens", "32",
         "--update-seqs", "16", "--micro", "4", "--variants", "deepspeed", "--warmup", "1", "--steps", "2",
         "--profile-steps", "1", "--fwd-micro", "4", "--out", str(out)],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {p.stem: json.loads(p.read_text()) for p in out.glob("profile_*.json")}
    # On CPU the FP8 GEMMs run `auto` (the emulated backend), which the file names carry.
    assert set(results) == {f"profile_deepspeed_m4_auto_{r}" for r in ("bf16", "jet_fp8")}, proc.stdout
    for r in results.values():
        assert r["micro_step_wall_ms"] > 0 and r["fwd_nograd_ms"] > 0 and r["kernels_captured"] > 0
        assert abs(sum(r["groups_ms"].values()) - r["micro_step_kernel_ms"]) < 0.05 + 0.01 * r["micro_step_kernel_ms"]
    # The FP8 model really ran its FP8 layers: their autograd functions (a layer's, or a stacked q/k/v or gate/up
    # group's: which of them ranks among the top ops depends on timing) or quantizers show up, and none in BF16's.
    def fp8_ops(recipe):
        names = [name for name, _, _ in results[f"profile_deepspeed_m4_auto_{recipe}"]["top_kernels_us"]]
        return [n for n in names if any(m in n for m in ("_Fp8LinearFunction", "_Fp8GroupFunction", "quant"))], names

    assert fp8_ops("jet_fp8")[0], fp8_ops("jet_fp8")[1]
    assert not fp8_ops("bf16")[0], fp8_ops("bf16")[0]
    assert "| micro-step wall |" in proc.stdout and "bf16 / jet_fp8" in proc.stdout

    # The plain variant, with --requantize-weights: a job of its own, named and recorded as such.
    proc = subprocess.run(
        [sys.executable, "benchmarks/update_profile.py", "--tiny", "--layers", "1", "--prompt-len", "16", "--new-tokens", "32",
         "--update-seqs", "16", "--micro", "4", "--variants", "plain", "--recipes", "jet_fp8", "jet_fp8+plainnorm",
         "jet_fp8+plaindy", "--requantize-weights", "--warmup",
         "1", "--steps", "1", "--profile-steps", "1", "--fwd-micro", "4", "--out", str(out)],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    requant = json.loads((out / "profile_plain_m4_auto_requant_jet_fp8.json").read_text())
    assert requant["requantize_weights"] is True and "FP8 weights re-quantized every call" in proc.stdout
    plainnorm = json.loads((out / "profile_plain_m4_auto_requant_jet_fp8+plainnorm.json").read_text())
    assert plainnorm["recipe"] == "jet_fp8+plainnorm" and plainnorm["micro_step_wall_ms"] > 0
    plaindy = json.loads((out / "profile_plain_m4_auto_requant_jet_fp8+plaindy.json").read_text())
    assert plaindy["recipe"] == "jet_fp8+plaindy" and plaindy["micro_step_wall_ms"] > 0

    # ZeRO-1 (gradients accumulated in place, no ZeRO-2 bucket copies per micro-step) and the backward on the calling
    # thread: variants of their own.
    proc = subprocess.run(
        [sys.executable, "benchmarks/update_profile.py", "--tiny", "--layers", "1", "--prompt-len", "16", "--new-tokens", "32",
         "--update-seqs", "16", "--micro", "4", "--variants", "deepspeed-zero1", "deepspeed-calling-thread", "--recipes", "jet_fp8", "--warmup", "1",
         "--steps", "1", "--profile-steps", "1", "--fwd-micro", "4", "--out", str(tmp_path / "zero1")],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    zero1 = json.loads((tmp_path / "zero1" / "profile_deepspeed-zero1_m4_auto_jet_fp8.json").read_text())
    assert zero1["variant"] == "deepspeed-zero1" and zero1["micro_step_wall_ms"] > 0
    assert "deepspeed-zero1, micro-batch 4" in proc.stdout
    calling = json.loads((tmp_path / "zero1" / "profile_deepspeed-calling-thread_m4_auto_jet_fp8.json").read_text())
    assert calling["autograd_worker_threads"] is False and zero1["autograd_worker_threads"] is True
    assert "deepspeed-calling-thread, micro-batch 4" in proc.stdout

    runs = tmp_path / "runs"
    recs = json.loads(update_profile.record(list(results.values()), None, "test", runs).read_text())
    assert {r["device"] for r in recs} == {"x86-64 CPU"}  # what the jobs recorded
    walls = [r for r in recs if r["name"] == "update_micro_step_wall_ms"]
    assert len(walls) == 2 and all(r["unit"] == "ms" for r in walls)
    bf, fp8 = ({(r["shape"], r["backend"]): r for r in walls}[(walls[0]["shape"], b)] for b in ("bf16", "jet_fp8"))
    assert bf["ratio_vs_bf16"] == 1.0 and fp8["ratio_vs_bf16"] == pytest.approx(bf["value"] / fp8["value"], rel=1e-3)


def test_liger_without_a_gpu_is_refused_in_one_line():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "update_profile.py"), "--liger", "--tiny"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--liger needs a CUDA GPU with Liger: no CUDA device" in proc.stderr.strip().splitlines()[-1]


def test_an_unknown_recipe_variant_is_refused_in_one_line():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "update_profile.py"), "--tiny", "--recipes", "jet_fp8+foo"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--recipes jet_fp8+foo: a recipe (bf16, fp8_rollout, jet_fp8), or an FP8 one with +plainnorm, +plaindy or +nativegemm" \
        in proc.stderr.strip().splitlines()[-1]
