"""The triton_invariant backend's route to cuBLASLt (on unless JETRL_INVARIANT_VENDOR_GEMM=off): the probe's verdict, when it runs, and what it routes.

On CPU the probe runs with stand-in GEMMs (the float64 reference and a copy of it that changes one output bit from
some M on); the real pair runs in tests/gpu/test_vendor_route_gpu.py.
"""

from __future__ import annotations

import logging

import pytest
import torch

from jetrl_precision.gemm import torch_backend, triton_invariant_backend, vendor_route
from jetrl_precision.gemm.emulated import emulated_gemm_nt
from jetrl_precision.quantize import quantize_fp8


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(vendor_route.VENDOR_ROUTE_ENV, raising=False)
    vendor_route.reset()
    yield
    vendor_route.reset()


def _differs_from(m0: int):
    """The reference GEMM, with one output element's last bit flipped once M >= m0."""
    def gemm(a, b, out_dtype):
        out = emulated_gemm_nt(a, b, out_dtype)
        if a.shape[0] >= m0:
            out = out.clone()
            out.view(torch.int16)[m0 - 1, 3] ^= 1
        return out
    return gemm


def _operands(n=256, k=384, m=vendor_route.ROUTE_MIN_M):
    g = torch.Generator().manual_seed(1)
    a = quantize_fp8((torch.randn(m, k, generator=g) * 3).to(torch.bfloat16), (1, 128))
    b = quantize_fp8((torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16), (128, 128))
    return a, b


def test_probe_passes_only_when_every_bit_agrees_at_every_m():
    same = vendor_route.probe_shape(256, 384, device="cpu", ms=(1, 8, 64, 100), invariant=emulated_gemm_nt,
                                    vendor=emulated_gemm_nt)
    assert same.passed and same.first_difference is None and same.ms == (1, 8, 64, 100)
    late = vendor_route.probe_shape(256, 384, device="cpu", ms=(1, 8, 64, 100), invariant=emulated_gemm_nt,
                                    vendor=_differs_from(64))
    assert not late.passed and late.first_difference == (64, 1)  # one bit of one element at the first M that differs


def test_bit_differences_counts_bits_not_values_and_operands_have_outliers():
    a = torch.tensor([1.0, 0.0, 2.0], dtype=torch.bfloat16)
    assert vendor_route.bit_differences(a, a.clone()) == 0
    assert vendor_route.bit_differences(a, torch.tensor([1.0, -0.0, 2.0 + 2**-6], dtype=torch.bfloat16)) == 2  # -0.0 != 0.0
    assert vendor_route.bit_differences(a, a[:2]) == 3  # a shape mismatch counts every element
    w, x = vendor_route.outlier_operands(64, 256, 32, "cpu", seed=5)
    assert w.shape == (64, 256) and x.shape == (32, 256) and w.dtype == x.dtype == torch.bfloat16
    assert torch.equal(w, vendor_route.outlier_operands(64, 256, 32, "cpu", seed=5)[0])  # the same every run
    row_norms = x.float().norm(dim=1)
    assert float(row_norms.max() / row_norms.min()) > 10  # rows of very different scale
    col_max = w.float().abs().amax(dim=0)
    assert float(col_max.max() / col_max.median()) > 5  # a few heavy weight columns


def test_on_by_default_off_when_asked_and_a_bad_value_is_one_clear_line(monkeypatch):
    assert vendor_route.route_enabled()  # unset: the route is the default
    for raw, on in (("probe", True), ("1", True), (" ON ", True), ("off", False), ("0", False)):
        assert vendor_route.route_setting({vendor_route.VENDOR_ROUTE_ENV: raw}) is on, raw
    a, b = _operands()
    monkeypatch.setenv(vendor_route.VENDOR_ROUTE_ENV, "off")
    vendor_route.reset()
    monkeypatch.setattr(vendor_route, "probe_shape", lambda *a, **k: pytest.fail("probed while the route is off"))
    assert not vendor_route.route_enabled() and not vendor_route.routed(a, b, torch.bfloat16)
    monkeypatch.setenv(vendor_route.VENDOR_ROUTE_ENV, "yes")
    vendor_route.reset()
    with pytest.raises(ValueError, match=r"^JETRL_INVARIANT_VENDOR_GEMM='yes': use 'probe'"):
        vendor_route.routed(a, b, torch.bfloat16)


def test_the_precision_graph_records_the_route_on_cuda_only(monkeypatch):
    from jetrl_precision.batch_invariant import NumericsReport

    assert vendor_route.route_state("cpu") == "-" and vendor_route.route_state("cuda") == "on"
    report = NumericsReport(True, "jetrl_invariant_triton", "triton_invariant", "triton_invariant", "triton",
                            vendor_route=vendor_route.route_state("cuda"))
    assert report.detail().endswith(" norm=triton vendor_route=on")
    monkeypatch.setenv(vendor_route.VENDOR_ROUTE_ENV, "off")
    vendor_route.reset()
    assert vendor_route.route_state(torch.device("cuda", 1)) == "off"
    assert "vendor_route" not in NumericsReport(True, "jetrl_invariant", "fp64", "emulated").detail()


def test_a_shape_is_probed_once_and_only_weights_are_routed(monkeypatch):
    monkeypatch.setenv(vendor_route.VENDOR_ROUTE_ENV, "probe")
    monkeypatch.setattr(torch_backend, "unavailable_reason", lambda device: None)
    calls = []

    def fake_probe(n, k, **kw):
        calls.append((n, k))
        return vendor_route.ProbeResult(n, k, (128, 128), "bfloat16", (1, 8), passed=n == 256,
                                        first_difference=None if n == 256 else (8, 3))

    monkeypatch.setattr(vendor_route, "probe_shape", fake_probe)
    a, b = _operands(n=256)
    assert vendor_route.routed(a, b, torch.bfloat16) and vendor_route.routed(a, b, torch.bfloat16)
    _, b2 = _operands(n=384)
    assert not vendor_route.routed(a, b2, torch.bfloat16)  # its probe failed: it stays on the kernel
    assert calls == [(256, 384), (384, 384)]
    # WGrad-like operands (1x128 along K) are never routed, and never probed
    b_1x128 = quantize_fp8(torch.randn(256, 384).to(torch.bfloat16), (1, 128))
    assert not vendor_route.routed(a, b_1x128, torch.bfloat16) and len(calls) == 2
    assert sorted(r.passed for r in vendor_route.routes().values()) == [False, True]


def test_no_probe_while_capturing_and_no_route_without_cublaslt(monkeypatch, caplog):
    monkeypatch.setenv(vendor_route.VENDOR_ROUTE_ENV, "probe")
    a, b = _operands()
    monkeypatch.setattr(vendor_route, "_capturing", lambda: True)
    monkeypatch.setattr(vendor_route, "probe_shape", lambda *a, **k: pytest.fail("probed inside a capture"))
    assert not vendor_route.routed(a, b, torch.bfloat16) and vendor_route.routes() == {}
    monkeypatch.setattr(vendor_route, "_capturing", lambda: False)
    with caplog.at_level(logging.WARNING, logger=vendor_route.__name__):
        assert not vendor_route.routed(a, b, torch.bfloat16)  # CPU: cuBLASLt's blockwise FP8 cannot run here
        assert not vendor_route.routed(a, _operands(n=384)[1], torch.bfloat16)  # a second shape: no second warning
    verdicts = list(vendor_route.routes().values())
    assert len(verdicts) == 2 and all(not v.passed and "cuBLASLt blockwise FP8 cannot run" in v.reason for v in verdicts)
    assert len([r for r in caplog.records if "stays on the invariant kernel" in r.getMessage()]) == 1


def test_the_backend_hands_a_routed_gemm_to_cublaslt(monkeypatch):
    a, b = _operands()
    sentinel = torch.full((8, 256), 7.0)
    monkeypatch.setattr(torch_backend, "torch_gemm_nt", lambda a_, b_, dt: sentinel)
    monkeypatch.setattr(triton_invariant_backend, "routed", lambda a_, b_, dt: True)
    assert triton_invariant_backend.triton_invariant_gemm_nt(a, b, torch.bfloat16) is sentinel
    monkeypatch.setattr(triton_invariant_backend, "routed", lambda a_, b_, dt: False)
    monkeypatch.setattr(triton_invariant_backend, "invariant_kernel_gemm_nt", lambda a_, b_, dt: "kernel")
    assert triton_invariant_backend.triton_invariant_gemm_nt(a, b, torch.bfloat16) == "kernel"


def test_the_bf16_twin_probes_f_linear_and_never_routes_off_the_gpu(monkeypatch):
    linear = torch.nn.functional.linear

    def late(x, w):
        out = linear(x, w)
        if x.shape[0] >= 16:
            out = out.clone()
            out.view(torch.int16)[0, 0] ^= 1
        return out

    same = vendor_route.probe_linear_shape(96, 64, device="cpu", ms=(1, 16, 40), invariant=linear, vendor=linear)
    assert same.passed and same.out_dtype == "bfloat16"
    differs = vendor_route.probe_linear_shape(96, 64, device="cpu", ms=(1, 16, 40), invariant=linear, vendor=late)
    assert not differs.passed and differs.first_difference == (16, 1)
    monkeypatch.setenv(vendor_route.VENDOR_ROUTE_ENV, "probe")
    monkeypatch.setattr(vendor_route, "probe_linear_shape", lambda *a, **k: pytest.fail("probed a CPU weight"))
    assert not vendor_route.routed_linear(torch.randn(96, 64, dtype=torch.bfloat16), torch.bfloat16, 4096)


def test_the_probe_stops_where_one_output_would_pass_a_gib():
    assert vendor_route._ms_for(28672) == vendor_route.PROBE_MS  # gate_up: every M up to 8192
    lm_head = vendor_route._ms_for(128256)
    assert max(lm_head) == 4096 and lm_head == tuple(m for m in vendor_route.PROBE_MS if m <= 4096)
    assert vendor_route._ms_for(1 << 30) == (1,)


def test_decode_sized_batches_stay_on_the_kernel_without_a_probe(monkeypatch):
    """Below ROUTE_MIN_M rows the invariant kernel is the faster one: no route, and no probe for it."""
    monkeypatch.setenv(vendor_route.VENDOR_ROUTE_ENV, "probe")
    monkeypatch.setattr(vendor_route, "_verdict", lambda *a: pytest.fail("looked up a decode-sized GEMM"))
    a, b = _operands(m=vendor_route.ROUTE_MIN_M - 1)
    assert not vendor_route.routed(a, b, torch.bfloat16)
