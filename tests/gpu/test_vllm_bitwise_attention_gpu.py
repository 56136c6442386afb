"""The bitwise mode's vLLM attention backend on the GPU (jetrl_precision.integrations.vllm_bitwise_attention).

1. The backend's impl alone, with vLLM's own cache write (`do_kv_cache_update`, the Triton backend's): a sequence of
   engine steps (chunked prefill next to a whole prompt, then mixed and pure decode steps, one of them captured in
   a CUDA graph and replayed with the next tokens) gives every token's attention row the bits of the trainer's
   kernel (`varlen_attention`) over the full sequences.
2. A small vLLM engine (a random tiny Llama, bf16, GQA, head_dim 64) with the backend selected, greedy, in vLLM's
   default mode (torch.compile + CUDA graphs) and eager: every attention layer runs our impl, eager runs it once
   per layer and step, default mode keeps full CUDA graphs for decode (UNIFORM_BATCH support).
Each engine runs in its own process (this file is also the job script: `python THIS --job MODE --model DIR --out F`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LAYERS, NEW_TOKENS, PROMPTS = 2, 24, 4


# ---- the engine job (runs in its own process) ----------------------------------------------------------------------
def _job(mode: str, model: str, out: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its layers and counter are ours
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model takes a function
    import vllm

    from jetrl_precision.integrations import vllm_bitwise_attention as vba
    from jetrl_precision.integrations.vllm_plugin import register

    register()  # vLLM also calls it through the entry point; explicit here so the job runs from a bare checkout
    llm = vllm.LLM(
        model, dtype="bfloat16", seed=0, max_model_len=256, gpu_memory_utilization=0.1, enforce_eager=mode == "eager",
        kv_cache_memory_bytes=1 << 28, **vba.bitwise_attention_engine_kwargs(),
    )
    impls = llm.apply_model(
        lambda m: sorted({type(x.impl).__name__ for x in m.modules() if hasattr(x, "impl") and hasattr(x, "attn_backend")})
    )
    checked = llm.apply_model(vba.check_bitwise_attention)
    calls_at_start = vba.forward_calls()
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 120, (n,), generator=g).tolist()} for n in (5, 17, 33, 40)]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    cfg = llm.llm_engine.vllm_config.compilation_config
    Path(out).write_text(json.dumps({
        "impls": impls,
        "checked": checked,
        "calls_at_start": calls_at_start,
        "calls_generate": vba.forward_calls() - calls_at_start,
        "cudagraph_mode": str(cfg.cudagraph_mode),
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
    }))


def _main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", choices=["default", "eager"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    _job(a.job, a.model, a.out)


if __name__ == "__main__":
    _main()
    sys.exit(0)

# ---- the tests -----------------------------------------------------------------------------------------------------
import pytest  # noqa: E402

from gpu_testutil import require_cuda_and_vllm  # noqa: E402

pytestmark = [pytest.mark.gpu]

require_cuda_and_vllm()

from precision_testutil import assert_same_bits, outlier_data  # noqa: E402

H, HKV, D, PAGE = 8, 2, 128, 16


class _Steps:
    """Sequences whose tokens arrive over engine steps; the cache is vLLM's (NHD, NaN where nothing was written)."""

    def __init__(self, lens: list[int], dtype=torch.bfloat16):
        from jetrl_precision.kernels.invariant_attention import varlen_attention

        g = torch.Generator().manual_seed(1)
        mk = lambda n, h: outlier_data((n, h, D), generator=g, sigma=0.5, spikes=3, spike_factor=8.0, dtype=dtype).cuda()  # noqa: E731
        self.seqs = [(mk(n, H), mk(n, HKV), mk(n, HKV)) for n in lens]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        full = varlen_attention(*(torch.cat([s[i] for s in self.seqs]) for i in range(3)), cu, cu, max(lens), D**-0.5)
        self.ref = [full[a:b] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
        nb = 64
        perm = (torch.randperm(nb - 1, generator=torch.Generator().manual_seed(2)) + 1).tolist()
        self.blocks = [[perm.pop() for _ in range(-(-n // PAGE))] for n in lens]
        self.kv_cache = torch.full((nb, PAGE, HKV, 2 * D), math.nan, dtype=dtype, device="cuda").transpose(1, 2)
        self.table = torch.zeros(len(lens) + 1, max(len(b) for b in self.blocks), dtype=torch.int32, device="cuda")
        for r, b in enumerate(self.blocks):
            self.table[r, : len(b)] = torch.tensor(b, dtype=torch.int32)

    def inputs(self, spans: dict[int, tuple[int, int]], pad_request: bool):
        """q, k, v, slot mapping and metadata of one step: request r computes its tokens [lo, hi)."""
        q, k, v, slots, qsl, seq_lens = [], [], [], [], [0], []
        for r in range(len(self.seqs)):
            lo, hi = spans.get(r, (0, 0))
            for dst, src in zip((q, k, v), self.seqs[r]):
                dst.append(src[lo:hi])
            slots += [self.blocks[r][t // PAGE] * PAGE + t % PAGE for t in range(lo, hi)]
            qsl.append(qsl[-1] + hi - lo)
            seq_lens.append(hi)
        if pad_request:  # CUDA-graph padding: a request with no queries
            qsl.append(qsl[-1])
            seq_lens.append(0)
        i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
        table = self.table[: len(seq_lens)]
        return torch.cat(q), torch.cat(k), torch.cat(v), torch.tensor(slots, dtype=torch.int64, device="cuda"), i32(qsl), i32(seq_lens), table


def _impl():
    from jetrl_precision.integrations.vllm_bitwise_attention import BitwiseAttentionImpl

    impl = BitwiseAttentionImpl(H, D, D**-0.5, HKV, None, None, "auto")
    layer = SimpleNamespace(_k_scale=torch.ones((), device="cuda"), _v_scale=torch.ones((), device="cuda"))
    return impl, layer


def _step(impl, layer, st: _Steps, spans, pad_request=False):
    q, k, v, slots, qsl, seq_lens, table = st.inputs(spans, pad_request)
    impl.do_kv_cache_update(layer, k, v, st.kv_cache, slots)  # vLLM's Triton cache write, before attention
    max_q = max(hi - lo for lo, hi in spans.values())
    md = SimpleNamespace(use_cascade=False, query_start_loc=qsl, seq_lens=seq_lens, block_table=table,
                         max_query_len=max_q, num_actual_tokens=q.shape[0])
    out = torch.empty_like(q)
    impl.forward(layer, q, k, v, st.kv_cache, md, output=out)
    return out


def _check(out, st: _Steps, spans):
    row = 0
    for r in range(len(st.seqs)):
        lo, hi = spans.get(r, (0, 0))
        assert_same_bits(out[row : row + hi - lo], st.ref[r][lo:hi], f"request {r} tokens [{lo}, {hi})")
        row += hi - lo


def test_engine_steps_equal_the_trainers_forward_bit_for_bit():
    impl, layer = _impl()
    st = _Steps([70, 40])
    # A chunk next to a whole prompt, chunks next to decodes, then decodes with a padding request.
    for spans in ({0: (0, 20), 1: (0, 37)}, {0: (20, 45), 1: (37, 38)}, {0: (45, 69), 1: (38, 39)}):
        _check(_step(impl, layer, st, spans), st, spans)
    spans = {0: (69, 70), 1: (39, 40)}
    _check(_step(impl, layer, st, spans, pad_request=True), st, spans)


def test_a_captured_decode_step_replays_bit_for_bit():
    """Decode of both requests (plus a padding request) captured once, replayed for the next tokens: the same bits as
    the trainer's forward, so the launch reads no host state that a replay would freeze."""
    impl, layer = _impl()
    lens = [60, 41]
    st = _Steps(lens)
    first = {0: (0, 50), 1: (0, 31)}
    _check(_step(impl, layer, st, first), st, first)
    spans = {0: (50, 51), 1: (31, 32)}
    q, k, v, slots, qsl, seq_lens, table = st.inputs(spans, pad_request=True)
    bufs = [t.clone() for t in (q, k, v, slots, qsl, seq_lens)]
    out = torch.empty_like(q)
    md = SimpleNamespace(use_cascade=False, query_start_loc=bufs[4], seq_lens=bufs[5], block_table=table, max_query_len=1,
                         num_actual_tokens=q.shape[0])

    def run():
        impl.do_kv_cache_update(layer, bufs[1], bufs[2], st.kv_cache, bufs[3])
        impl.forward(layer, bufs[0], bufs[1], bufs[2], st.kv_cache, md, output=out)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()  # warm-up outside the capture (Triton compiles here)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for t in range(50, 60):
        spans = {0: (t, t + 1), 1: (t - 19, t - 18)}
        for buf, new in zip(bufs, st.inputs(spans, pad_request=True)):
            buf.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        _check(out, st, spans)


@pytest.fixture(scope="module")
def engine_results(tmp_path_factory) -> dict[str, dict]:
    from openrlhf.utils.tiny_model import TinyModelSpec, build_tiny_model

    base = tmp_path_factory.mktemp("vllm_bitwise_attention")
    spec = TinyModelSpec(hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, initializer_range=0.2)
    model = build_tiny_model(base / "tiny", spec, dtype=torch.bfloat16)
    res = {}
    for mode in ("default", "eager"):
        out = base / f"{mode}.json"
        log = base / f"{mode}.log"
        with open(log, "w") as f:
            rc = subprocess.run([sys.executable, __file__, "--job", mode, "--model", str(model), "--out", str(out)],
                                stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ), timeout=900).returncode
        if rc != 0 or not out.exists():
            pytest.fail(f"vLLM job {mode} exited {rc}:\n{log.read_text()[-4000:]}")
        res[mode] = json.loads(out.read_text())
    return res


@pytest.mark.slow
def test_engine_attention_runs_through_the_bitwise_backend(engine_results):
    for mode, r in engine_results.items():
        assert r["impls"] == [["BitwiseAttentionImpl"]], f"{mode}: attention layers run {r['impls']}"
        assert r["checked"] == [LAYERS], mode
        assert all(len(t) == NEW_TOKENS for t in r["tokens"]), mode
    eager = engine_results["eager"]
    # Eager: one call per layer per engine step; all prompts fit one batch, so NEW_TOKENS steps at least.
    assert eager["calls_generate"] % LAYERS == 0 and eager["calls_generate"] >= LAYERS * NEW_TOKENS, eager["calls_generate"]
    default = engine_results["default"]
    # Default mode: decode steps replay full graphs captured through our forward (no Python call at replay), the
    # prefill step runs piecewise with attention eager.
    assert "FULL" in default["cudagraph_mode"], default["cudagraph_mode"]
    assert default["calls_at_start"] >= LAYERS, "graph capture must have run our forward"
    assert LAYERS <= default["calls_generate"] < eager["calls_generate"], (default["calls_generate"], eager["calls_generate"])
