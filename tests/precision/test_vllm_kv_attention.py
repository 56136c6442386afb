"""Which attention layers get the e4m3 cache's split-KV decode kernel (`integrations.vllm_kv_attention`): a decoder
layer on vLLM's Triton backend does, in place; a layer the kernel cannot serve, another backend, or
JETRL_KV_DECODE=0 keeps vLLM's kernel with one log line; the precision graph labels both as the e4m3 cache.
The kernel's arithmetic and routing run in tests/precision/test_decode_attention_interpret.py (Triton's interpreter)."""

from __future__ import annotations

import logging
import types

import pytest

pytest.importorskip("vllm")

from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl  # noqa: E402

from jetrl_precision.integrations import vllm_kv_attention as kva  # noqa: E402


def _layer(**kw):
    args = dict(num_heads=8, head_size=64, scale=0.125, num_kv_heads=2, alibi_slopes=None, sliding_window=None,
                kv_cache_dtype="fp8_e4m3")
    return types.SimpleNamespace(impl=TritonAttentionImpl(**{**args, **kw}))


@pytest.fixture(autouse=True)
def _fresh_log(monkeypatch):
    monkeypatch.setattr(kva, "_logged", set())
    monkeypatch.delenv("JETRL_KV_DECODE", raising=False)


def test_a_decoder_layer_on_the_triton_backend_gets_the_kernel_in_place():
    layer = _layer()
    impl = layer.impl
    assert kva.install_kv_decode(layer) and kva.install_kv_decode(layer)  # idempotent
    assert layer.impl is impl and type(impl) is kva.KVDecodeAttentionImpl and impl.head_size == 64


@pytest.mark.parametrize("kw, why", [(dict(sliding_window=128), "sliding window"), (dict(logits_soft_cap=30.0), "soft-capping"),
                                     (dict(alibi_slopes=[0.5] * 8), "ALiBi")])
def test_what_the_kernel_lacks_keeps_vllms_kernel_and_says_so_once(kw, why, caplog):
    with caplog.at_level(logging.WARNING, logger=kva.__name__):
        layers = [_layer(**kw), _layer(**kw)]
        assert not any(kva.install_kv_decode(layer) for layer in layers)
    assert all(type(layer.impl) is TritonAttentionImpl for layer in layers)
    assert len(caplog.records) == 1 and why in caplog.records[0].getMessage()


def test_the_switch_and_other_backends_keep_their_kernel(monkeypatch, caplog):
    monkeypatch.setenv("JETRL_KV_DECODE", "0")
    layer = _layer()
    with caplog.at_level(logging.WARNING, logger=kva.__name__):
        assert not kva.install_kv_decode(layer)
    assert type(layer.impl) is TritonAttentionImpl and "JETRL_KV_DECODE=0" in caplog.text
    monkeypatch.delenv("JETRL_KV_DECODE")
    other = types.SimpleNamespace(impl=object())  # a layer on another attention backend
    with caplog.at_level(logging.WARNING, logger=kva.__name__):
        assert not kva.install_kv_decode(other)
    assert "attention runs object, not vLLM's Triton backend" in caplog.text


def test_the_graph_labels_the_kernel_as_the_e4m3_cache_it_reads():
    from jetrl_precision.integrations.vllm_worker import engine_attention_impls, engine_kv_cache_label
    from jetrl_precision.kv_cache import e4m3_label

    class Attn(types.SimpleNamespace):
        pass

    layer = _layer()
    kva.install_kv_decode(layer)
    model = types.SimpleNamespace(modules=lambda: [Attn(impl=layer.impl, kv_cache_dtype="fp8_e4m3", _k_scale_float=1.0,
                                                         _v_scale_float=1.0, query_quant=None)])
    assert engine_kv_cache_label(model) == e4m3_label("nearest-even")
    assert engine_attention_impls(model) == "KVDecodeAttentionImpl"
