"""The host path of an FP8 training step, on CPU: step plans, bound quantizers, direct Triton launches, the
DeepGEMM-absent log line, and the host-cost proxy (the CUDA code path with stubbed kernels, checked bit for bit
against the reference path, and its host work held to a budget).

The GPU side (direct launches against kernel[grid], planned against unplanned bytes per backend) is
tests/gpu/test_train_plan_gpu.py.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from precision_testutil import outlier_data
from jetrl_precision import Fp8Linear, get_recipe, mark_weights_updated, ops, quantize_fp8
from jetrl_precision.gemm import dispatch, prepare_gemm
from jetrl_precision.gemm import deep_gemm_backend
from jetrl_precision.kernels import launch

ROOT = Path(__file__).resolve().parents[2]
JET = get_recipe("jet_fp8")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# ---- bound quantizers and prepared GEMMs give the bytes of the unbound calls ----------------------------------
def test_bound_quantizers_equal_the_dispatching_calls():
    x = outlier_data((200, 384))
    bw = JET.train_backward
    q = ops.quantizer(JET.train_fprop.input, "cpu")(x)
    ref = ops.quantize(x, JET.train_fprop.input)
    assert torch.equal(_bytes(q.data), _bytes(ref.data)) and torch.equal(q.scale, ref.scale) and q.block == (1, 128)
    a, b = ops.dual_quantizer(bw.dgrad_grad_output, bw.wgrad_grad_output, "cpu")(x)
    ra, rb = ops.quantize_dual(x, bw.dgrad_grad_output, bw.wgrad_grad_output)
    for got, want in ((a, ra), (b, rb)):
        assert got.block == want.block and torch.equal(_bytes(got.data), _bytes(want.data)) and torch.equal(got.scale, want.scale)
    t = ops.transposed_quantizer(bw.wgrad_grad_output, "cpu")(x)
    assert torch.equal(_bytes(t.data), _bytes(quantize_fp8(x, (128, 1)).t().data))
    r = ops.transposed_requantizer(bw.wgrad_input, "cpu")(ref)
    assert torch.equal(_bytes(r.data), _bytes(ops.requantize_transposed(ref, bw.wgrad_input).data))


def test_generic_prepared_gemm_is_gemm_nt():
    g = torch.Generator().manual_seed(3)
    a = quantize_fp8(outlier_data((64, 256), generator=g), (1, 128))
    w = quantize_fp8(outlier_data((384, 256), generator=g), (128, 128))
    pg = prepare_gemm("emulated", "cpu")
    assert pg.weight(w) is None
    assert torch.equal(pg.nt_weight(a, None, w, torch.float32), dispatch.gemm_nt(a, w, torch.float32, "emulated"))
    with pytest.raises(dispatch.BackendUnavailable, match="unknown GEMM backend"):
        prepare_gemm("cublas", "cpu")


def test_quantized_tensor_trusted_skips_checks_only():
    qt = quantize_fp8(outlier_data((8, 256)), (1, 128))
    t = type(qt).trusted(qt.data, qt.scale, qt.block)
    assert t == qt and t.shape == qt.shape and torch.equal(t.dequantize(), qt.dequantize())


# ---- step plans -------------------------------------------------------------------------------------------------
def _layer(k=256, n=384, backend="emulated"):
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=True)
    with torch.no_grad():
        lin.weight.copy_(outlier_data((n, k)) * 0.05)
    return lin, Fp8Linear.from_linear(lin, JET.train_fprop, JET.train_backward, backend)


def test_plan_follows_the_backend_and_is_dropped_with_the_cache():
    lin, f8 = _layer()
    x = outlier_data((32, 256))
    f8(x)
    plan = f8._plans[x.device]
    assert plan.backend == "emulated" and f8.resolved_backend == "emulated"
    f8(x)
    assert f8._plans[x.device] is plan, "a step reuses the layer's plan"
    f8.gemm_backend = "auto"  # on CPU auto resolves to emulated as well, through a new plan
    f8(x)
    assert f8._plans[x.device] is not plan and f8._plans[x.device].requested == ("auto", None)
    f8.invalidate_cache()
    assert not f8._plans


def _fwd_bwd(layer, x, dy):
    x = x.clone().requires_grad_(True)
    layer.weight.grad = layer.bias.grad = None
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def test_zero3_style_weights_are_not_kept_from_forward_to_backward():
    """A ZeRO-3 parameter (ds_id set) is gathered per use: no FP8 copy of it outlives the forward, and the step's
    numbers are those of the same layer with a cacheable weight."""
    x, dy = outlier_data((48, 256)), outlier_data((48, 384)) * 1e-2
    lin, f8 = _layer()
    want = _fwd_bwd(f8, x, dy)
    assert f8._wq_cache is not None and f8._wq_t_cache is not None
    lin3, f83 = _layer()
    lin3.weight.ds_id = 7  # what DeepSpeed ZeRO-3 sets on a partitioned parameter
    got = _fwd_bwd(f83, x, dy)
    assert f83._wq_cache is None and f83._wq_t_cache is None
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_wgrad_operands_come_padded_as_the_backward_gemm_asks(monkeypatch):
    """A backward GEMM that needs the token count (WGrad's K) in multiples of 128 gets both operands padded by the
    quantizers: zero columns, the same scales, and the same weight gradient as unpadded operands give."""
    from jetrl_precision.gemm.dispatch import PreparedGemm
    from jetrl_precision.kernels.layout import pad_columns

    x, dy = outlier_data((200, 256)), outlier_data((200, 384)) * 1e-2
    _, plain = _layer()
    want = _fwd_bwd(plain, x, dy)
    seen = []

    class Padded(PreparedGemm):
        wgrad_k_multiple = 128

        def nt(self, a, b, out_dtype):
            seen.append((tuple(a.shape), tuple(b.shape)))
            return super().nt(a, b, out_dtype)

    import jetrl_precision.linear as linear_mod

    monkeypatch.setattr(linear_mod, "prepare_gemm", lambda name, device: Padded(name))  # the plan's GEMMs want K % 128
    _, f8 = _layer()
    got = _fwd_bwd(f8, x, dy)
    assert seen == [((384, 256), (256, 256))], seen  # K = 200 tokens -> 256
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    # The helper other implementations pad with: zeros after the data, scales untouched; K already a multiple stays.
    q = quantize_fp8(x, (128, 1)).t()
    p = pad_columns(q, 128)
    assert p.shape == (256, 256) and torch.equal(p.scale, q.scale) and not p.data[:, 200:].view(torch.uint8).any()
    assert torch.equal(_bytes(p.data[:, :200]), _bytes(q.data)) and pad_columns(p, 128) is p and pad_columns(q, 0) is q
    with pytest.raises(ValueError, match="multiple of 128"):
        pad_columns(q, 64)


def test_dgrad_uses_the_transpose_of_the_forwards_weight():
    lin, f8 = _layer()
    x, dy = outlier_data((16, 256)), outlier_data((16, 384))
    _fwd_bwd(f8, x, dy)
    wq = f8.quantized_weight()
    assert f8._wq_t_cache[0] is wq
    assert torch.equal(_bytes(f8.quantized_weight_t().data), _bytes(wq.data.t()))
    mark_weights_updated()
    _fwd_bwd(f8, x, dy)
    assert f8.quantized_weight() is not wq and f8._wq_t_cache[0] is f8.quantized_weight()


# ---- direct Triton launches: the launcher's logic, with a stand-in JIT function --------------------------------
class _Compiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "fn-handle", "packed"

    def run(self, *args):
        self.log.append(("direct", args))


class _Kernel:
    arg_names = ["x_ptr", "n", "BLOCK", "POW2"]

    def __init__(self):
        self.log = []
        self.compiled = _Compiled(self.log)

    def __getitem__(self, grid):
        def go(*args, **meta):
            self.log.append(("jit", grid, args, meta))
            return self.compiled

        return go


@pytest.fixture
def direct(monkeypatch):
    monkeypatch.setitem(launch._status, "enabled", True)
    monkeypatch.setitem(launch._status, "why", "test")
    monkeypatch.setattr(launch, "_hooks_set", lambda: False)
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    monkeypatch.setattr(launch, "_raw_stream", lambda dev: 1234)


def test_repeat_launches_call_the_compiled_launcher(direct):
    k = _Kernel()
    lau = launch.TritonLauncher(k, "k")
    x = torch.zeros(64)
    lau((4, 2), x, 64, BLOCK=32, POW2=False, num_warps=4)
    lau((4, 2), x, 64, BLOCK=32, POW2=False, num_warps=4)
    assert [e[0] for e in k.log] == ["jit", "direct"]
    # grid, stream, function, packed metadata, no launch metadata, no hooks, then every parameter in order.
    assert k.log[1][1] == (4, 2, 1, 1234, "fn-handle", "packed", None, None, None, x, 64, 32, False)
    lau((4, 2), x, 65, BLOCK=32, POW2=False, num_warps=4)  # another int value: another specialization
    lau((4, 2), x[1:], 64, BLOCK=32, POW2=False, num_warps=4)  # a 4-byte offset: another alignment
    lau((4, 2), x, 64, BLOCK=64, POW2=False, num_warps=4)  # another constexpr
    assert [e[0] for e in k.log[2:]] == ["jit", "jit", "jit"]


def test_a_refused_direct_launch_falls_back_and_disables(direct, caplog):
    k = _Kernel()
    lau = launch.TritonLauncher(k, "k")
    x = torch.zeros(16)
    lau((1,), x, 16, BLOCK=16, POW2=True)

    def refuse(*args):
        raise TypeError("function takes exactly 14 arguments")

    k.compiled.run = refuse
    lau._table.clear()
    lau((1,), x, 16, BLOCK=16, POW2=True)  # re-learns the (now refusing) launcher
    with caplog.at_level(logging.WARNING):
        lau((1,), x, 16, BLOCK=16, POW2=True)
    assert [e[0] for e in k.log] == ["jit", "jit", "jit"], "the refused launch went through kernel[grid] instead"
    assert launch._status["enabled"] is False and "disabled" in caplog.text and "14 arguments" in caplog.text


class _HookChain:
    """Triton 3.6's knobs.runtime.launch_enter_hook: a chain of callables, never None."""

    def __init__(self, calls):
        self.calls = calls

    def __call__(self, *args):
        for c in self.calls:
            c(*args)


@pytest.mark.parametrize("hook, active", [(None, False), (_HookChain([]), False), (_HookChain([print]), True),
                                          (print, True)])
def test_only_a_hook_that_would_run_turns_direct_launches_off(hook, active):
    assert launch._hook_active(hook) is active


def test_parameters_by_position_or_keyword_keep_their_order(direct):
    k = _Kernel()
    lau = launch.TritonLauncher(k, "k")
    x = torch.zeros(16)
    lau((1,), x, 16, 8, POW2=True)  # BLOCK by position
    lau((1,), x, 16, 8, POW2=True)
    assert [e[0] for e in k.log] == ["jit", "direct"] and k.log[1][1][-4:] == (x, 16, 8, True)
    k2 = _Kernel()
    lau2 = launch.TritonLauncher(k2, "k2")
    lau2((1,), x, 16, BLOCK=16)  # a parameter not passed at all: no shortcut is learnt, and none is trusted again
    assert launch._status["enabled"] is False and "POW2" in launch._status["why"]


def test_override_takes_every_launch(direct):
    k = _Kernel()
    lau = launch.TritonLauncher(k, "kname")
    seen = []
    with launch.override_launches(lambda *a: seen.append(a)):
        lau((2,), torch.zeros(4), 4, BLOCK=4, POW2=False)
    assert seen and seen[0][0] == "kname" and not k.log
    assert launch.launch_override() is None


def test_status_off_outside_the_checked_versions(monkeypatch):
    monkeypatch.setattr(launch, "_status", {})
    monkeypatch.setattr(launch, "_triton_version", lambda: (3, 9))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("JETRL_TRITON_DIRECT_LAUNCH", "1")
    ok, why = launch.direct_launch_status()
    assert not ok and "3.9 is outside the checked versions" in why
    monkeypatch.delenv("JETRL_TRITON_DIRECT_LAUNCH", raising=False)
    for ver, want in (((3, 6), True), ((3, 5), False)):  # on where the GPU test passed, opt-in where it has not run
        monkeypatch.setattr(launch, "_status", {})
        monkeypatch.setattr(launch, "_triton_version", lambda v=ver: v)
        ok, why = launch.direct_launch_status()
        assert ok is want, why
    assert "JETRL_TRITON_DIRECT_LAUNCH=1 turns direct launches on" in why
    monkeypatch.setattr(launch, "_status", {})
    monkeypatch.setenv("JETRL_TRITON_DIRECT_LAUNCH", "1")
    assert launch.direct_launch_status() == (True, "triton 3.5")
    monkeypatch.setattr(launch, "_status", {})
    monkeypatch.setattr(launch, "_triton_version", lambda: (3, 6))
    monkeypatch.setenv("JETRL_TRITON_DIRECT_LAUNCH", "0")
    assert launch.direct_launch_status() == (False, "JETRL_TRITON_DIRECT_LAUNCH=0")


# ---- DeepGEMM absent: one clear line -----------------------------------------------------------------------------
def test_auto_says_once_that_deep_gemm_is_missing_and_how_to_get_it(monkeypatch, caplog):
    dispatch._ensure_registered()
    reason = deep_gemm_backend.missing_reason()
    if reason is None:
        pytest.skip("deep_gemm imports here")
    for name in ("torch", "triton"):
        b = dispatch._REGISTRY[name]
        monkeypatch.setitem(dispatch._REGISTRY, name, dispatch.GemmBackend(name, b.gemm_nt, lambda d: None))
    dg = dispatch._REGISTRY["deep_gemm"]
    monkeypatch.setitem(dispatch._REGISTRY, "deep_gemm", dispatch.GemmBackend("deep_gemm", dg.gemm_nt, lambda d: reason))
    monkeypatch.setattr(dispatch, "_logged_choices", set())
    with caplog.at_level(logging.INFO, logger="jetrl_precision.gemm.dispatch"):
        assert dispatch.resolve_backend("auto", "cuda") == "torch"
        assert dispatch.resolve_backend("auto", "cuda") == "torch"
    recs = [r for r in caplog.records if r.name == "jetrl_precision.gemm.dispatch"]
    assert len(recs) == 1 and recs[0].levelno == logging.WARNING
    msg = recs[0].getMessage()
    assert "\n" not in msg and "deep_gemm skipped: DeepGEMM is not installed" in msg and "build_deep_gemm.sh" in msg
    # Skipped for another reason (not sm90, say): information, not a warning.
    monkeypatch.setitem(dispatch._REGISTRY, "deep_gemm", dispatch.GemmBackend("deep_gemm", dg.gemm_nt, lambda d: "this GPU is sm80"))
    monkeypatch.setattr(dispatch, "_logged_choices", set())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jetrl_precision.gemm.dispatch"):
        dispatch.resolve_backend("auto", "cuda")
    assert [r.levelno for r in caplog.records if r.name == "jetrl_precision.gemm.dispatch"] == [logging.INFO]


# ---- the host-cost proxy ------------------------------------------------------------------------------------------
# Host work of one step on the CUDA code path (counted with kernels stubbed), at most these. Each was measured with
# some headroom; a change that adds Python hops, torch calls, allocations or launches to the hot path fails here.
BUDGET = {
    "Fp8Linear fwd+bwd": {"launches": 7, "allocations": 8, "aten_ops": 12, "torch_calls": 38, "extra_python_calls": 75},
    "Fp8Linear fwd no_grad": {"launches": 2, "allocations": 2, "aten_ops": 2, "torch_calls": 34, "extra_python_calls": 40},
}


@pytest.mark.slow
def test_host_cost_proxy_checks_bytes_and_holds_the_budget(tmp_path):
    out = tmp_path / "host_cost.json"
    # Its own process: the proxy patches the device checks of the modules it measures.
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_cost.py"), "--check", "--json", str(out),
                        "--shapes", "256x512x768,200x384x640"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["check_problems"] == []
    rows = {(row["shape"], row["step"]): row for row in res["rows"]}
    aligned = "M=256 K=512 N=768"
    bf16 = rows[(aligned, "nn.Linear fwd+bwd")]
    for step, budget in BUDGET.items():
        row = rows[(aligned, step)]
        assert row["launches"] == budget["launches"], row
        for key in ("allocations", "aten_ops", "torch_calls"):
            assert row[key] <= budget[key], (step, key, row[key])
        base = bf16["python_calls"] if "bwd" in step else 0
        assert row["python_calls"] - base <= budget["extra_python_calls"], (step, row["python_calls"], base)
    # An eager engine's FP8 projection call (EngineLinear's prepared plan): the CUDA activation quantizer's launch into
    # the per-(stream, K) workspace and one GEMM (whose output scaled_mm allocates, in its stub here): no allocation
    # of ours, a handful of Python calls; M = 3 adds only the slice of the M-padded output.
    for m in (64, 3):
        call = rows[(f"engine M={m} K=512 N=768", "EngineLinear call")]
        assert call["launch_names"] == {"quant_1x128_rows": 1, "torch._scaled_mm": 1}, call
        assert call["allocations"] == 0 and call["python_calls"] <= 8 and call["torch_calls"] <= 15, call
    # The ragged shape (M % 128 != 0) takes the padding paths; same launches, bytes checked above.
    assert rows[("M=200 K=384 N=640", "Fp8Linear fwd+bwd")]["launches"] == 7
    # A decoder layer: q/k/v and gate/up run as stacked GEMMs (grouped.py), SwiGLU's product is quantized in its own
    # kernel and its backward kernel writes gate/up's 1x128 dY, each norm quantizes for its projections: 2 norms, 2 norm
    # backwards, 2 SwiGLU kernels, 4 1x128 quantizers (o_proj's input, 3 dYs), 4 dY^T, 4 requantizers, 12 GEMMs. With
    # the plain norms, 2 activation quantizers instead of the norms' 4 launches (28), and the norms' ~40 aten ops more;
    # with every projection on its own GEMM, 46 launches (gate/up's dY then quantized apart, after the SwiGLU backward).
    # The SwiGLU backward's kernel path costs ~20 Python calls more than autograd's four aten ops would.
    shape = "256 tokens, hidden 512, MLP 1024"
    layer = rows[(shape, "decoder layer fwd+bwd jet_fp8")]
    plain = rows[(shape, "decoder layer fwd+bwd jet_fp8 plain norms")]
    assert layer["launch_names"]["_rmsnorm_quant_kernel"] == 2 and layer["launch_names"]["_rmsnorm_bwd_kernel"] == 2, layer
    assert layer["launch_names"]["_silu_mul_bwd_quant_kernel"] == 1 and layer["launch_names"]["_quant_1x128_kernel"] == 4, layer
    assert layer["launches"] == 30 and layer["allocations"] <= 42 and layer["python_calls"] <= 585, layer
    assert plain["launches"] == 28 and plain["allocations"] <= 37 and plain["python_calls"] <= 500, plain
    assert layer["aten_ops"] <= plain["aten_ops"] - 30, (layer["aten_ops"], plain["aten_ops"])
    assert rows[(shape, "decoder layer fwd+bwd jet_fp8 separate")]["launches"] == 46
    # The no-grad forward (reference / old-logprob passes): 2 norms + 1 input quantizer, 1 SwiGLU, 4 GEMMs (7 GEMMs
    # separate); the plain norms' forward: 3 input quantizers instead of the 2 norms.
    assert rows[(shape, "decoder layer fwd no_grad jet_fp8")]["launches"] == 8
    assert rows[(shape, "decoder layer fwd no_grad jet_fp8 plain norms")]["launches"] == 8
    assert rows[(shape, "decoder layer fwd no_grad jet_fp8 separate")]["launches"] == 11
