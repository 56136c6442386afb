"""The split-KV decode attention (`jetrl_precision.kernels.decode_attention`) in Triton's CPU interpreter: each
decode row against the float64 attention of the dequantized e4m3 (or BF16) cache, within the worst-case bound of
`precision_testutil.attention_bound`, for one slice and for several (the log-sum-exp merge), through a shuffled block
table; rows the kernel must leave alone (CUDA-graph padding, a two-token query) stay as they were. The bound is not
vacuous: the same rows against a reference blind to each sequence's newest key fall outside it.

The interpreter evaluates tl.dot with numpy, not the tensor cores, so this checks the kernel's logic (slicing,
masking, paging, the merge); tests/gpu/test_decode_attention_gpu.py checks it on the hardware against vLLM's own
kernel. The kernels run in a subprocess because TRITON_INTERPRET is read when they are defined.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (make test puts it on the path)")

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import json, math, torch
from precision_testutil import attention_bound, outlier_data
from jetrl_precision.formats import E4M3_MAX, FP8_DTYPE
from jetrl_precision.kernels.decode_attention import BLOCK_N, decode_attention

g = torch.Generator().manual_seed(3)
report = []
for dim, heads, kv_heads, cache, qdt in ((64, 8, 2, "e4m3", torch.bfloat16), (64, 8, 2, "bf16", torch.bfloat16),
                                         (80, 6, 3, "e4m3", torch.bfloat16), (64, 8, 2, "e4m3", torch.float16)):
    page, blocks = 16, 48
    lens = [1, 17, 64, 65, 203, 0, 40]          # 0: CUDA-graph padding (no query); the last sequence has two queries
    q_lens = [1, 1, 1, 1, 1, 0, 2]
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    t = int(cu[-1])
    q = outlier_data((t, heads, dim), group=dim, generator=g).to(qdt)
    k_all = outlier_data((blocks * page, kv_heads, dim), group=dim, generator=g).clamp(-E4M3_MAX, E4M3_MAX)
    v_all = outlier_data((blocks * page, kv_heads, dim), group=dim, generator=g).clamp(-E4M3_MAX, E4M3_MAX)
    store = FP8_DTYPE if cache == "e4m3" else qdt
    k_cache = k_all.to(store).view(blocks, page, kv_heads, dim)
    v_cache = v_all.to(store).view(blocks, page, kv_heads, dim)
    perm = torch.randperm(blocks, generator=g)  # each sequence's pages scattered over the cache
    max_pages = -(-max(lens) // page)
    table = torch.stack([perm[(i * 7 + torch.arange(max_pages)) % blocks] for i in range(len(lens))]).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    for splits in (1, 3, 16, None):
        out = torch.full_like(q, 7.0)
        decode_attention(q, k_cache, v_cache, cu, seq_lens, table, out=out, splits=splits)
        for s, (n, ql) in enumerate(zip(lens, q_lens)):
            rows = out[int(cu[s]):int(cu[s]) + ql]
            if ql != 1:
                report.append({"case": f"{cache} D={dim} q {qdt} splits={splits} seq {s}", "untouched": bool((rows == 7.0).all())})
                continue
            pos = torch.arange(n)
            phys = table[s, pos // page].long() * page + pos % page
            ks = k_cache.view(-1, kv_heads, dim)[phys].float()  # the dequantized keys and values (exact in fp32)
            vs = v_cache.view(-1, kv_heads, dim)[phys].float()
            qs = torch.zeros(n, heads, dim, dtype=qdt)
            qs[-1] = q[int(cu[s])]                          # the decode query sits at the newest position
            # the kernel's rescalings: one per tile of BLOCK_N keys (slices are whole tiles) and one for the merge of
            # slices; counting one per BLOCK_N // 2 keys covers both
            ref, bound = attention_bound(qs, ks, vs, dim**-0.5, key_block=BLOCK_N // 2)
            got = out[int(cu[s])].double()
            err = (got - ref[-1]).abs()
            row = {"case": f"{cache} D={dim} q {qdt} splits={splits} seq {s} (n={n})", "inside": bool((err <= bound[-1]).all()),
                   "max_err": float(err.max()), "max_bound": float(bound[-1].max())}
            if n > 1:  # a reference blind to the newest key: the bound must not hold against it
                blind, _ = attention_bound(qs[:-1].contiguous(), ks[:-1], vs[:-1], dim**-0.5, key_block=BLOCK_N // 2)
                row["blind_inside"] = bool(((got - blind[-1]).abs() <= bound[-1]).all())
            report.append(row)
print(json.dumps(report))
"""


def test_decode_rows_are_attention_of_the_dequantized_cache_within_the_bound():
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), *sys.path])}
    r = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    decoded = [row for row in rows if "inside" in row]
    assert len(decoded) == 4 * 4 * 5 and len(rows) - len(decoded) == 4 * 4 * 2
    outside = [row for row in decoded if not row["inside"]]
    assert not outside, outside[:3]
    assert all(row["untouched"] for row in rows if "untouched" in row), [r for r in rows if r.get("untouched") is False]
    blind = [row for row in decoded if "blind_inside" in row]
    assert blind and not any(row["blind_inside"] for row in blind), [r for r in blind if r["blind_inside"]][:3]


_ENGINE_SCRIPT = r"""
import json, types, torch
from precision_testutil import attention_bound, outlier_data
from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl
from jetrl_precision.formats import E4M3_MAX, FP8_DTYPE
from jetrl_precision.integrations.vllm_kv_attention import install_kv_decode
from jetrl_precision.kernels.decode_attention import BLOCK_N

g = torch.Generator().manual_seed(5)
heads, kv_heads, dim, page, blocks = 8, 2, 64, 16, 12
impl = TritonAttentionImpl(heads, dim, dim**-0.5, kv_heads, None, None, "fp8_e4m3")
assert install_kv_decode(types.SimpleNamespace(impl=impl))
# vLLM's Triton cache: logical [blocks, Hkv, page, 2D] (K in [:D], V in [D:]) over an NHD physical layout, in bytes
phys = outlier_data((blocks, page, kv_heads, 2 * dim), group=dim, generator=g).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
kv_cache = phys.view(torch.uint8).permute(0, 2, 1, 3)
lens = [37, 90]
table = torch.tensor([[3, 7, 1, 0, 0, 0], [11, 2, 9, 4, 6, 8]], dtype=torch.int32)
q = outlier_data((2, heads, dim), group=dim, generator=g).to(torch.bfloat16)
meta = types.SimpleNamespace(max_query_len=1, num_actual_tokens=2, query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table)
out = torch.full((4, heads, dim), 7.0, dtype=torch.bfloat16)  # two rows past num_actual_tokens (graph padding)
impl.forward(None, torch.cat([q, q]), None, None, kv_cache, meta, out)
rows = []
for s, n in enumerate(lens):
    pos = torch.arange(n)
    idx = table[s, pos // page].long(), pos % page
    kv = phys[idx[0], idx[1]].float()  # [n, Hkv, 2D]
    qs = torch.zeros(n, heads, dim, dtype=torch.bfloat16)
    qs[-1] = q[s]
    ref, bound = attention_bound(qs, kv[..., :dim].contiguous(), kv[..., dim:].contiguous(), dim**-0.5, key_block=BLOCK_N // 2)
    rows.append(bool(((out[s].double() - ref[-1]).abs() <= bound[-1]).all()))
calls = []
vllm_forward = TritonAttentionImpl.forward
TritonAttentionImpl.forward = lambda self, *a, **k: calls.append(a[5].max_query_len)  # record the route only
impl.forward(None, q, None, None, kv_cache, types.SimpleNamespace(**{**vars(meta), "max_query_len": 2}), out)
TritonAttentionImpl.forward = vllm_forward
print(json.dumps({"inside": rows, "padding_untouched": bool((out[2:] == 7.0).all()), "prefill_to_vllm": calls}))
"""


def test_the_engine_layer_runs_decode_steps_through_the_kernel_on_vllms_cache_layout():
    """KVDecodeAttentionImpl.forward on vLLM's Triton cache layout (K and V packed per slot, NHD physical order, bytes
    viewed as e4m3): decode rows within the bound of the float64 attention of that cache, rows past the step's tokens
    untouched, and a step with a longer query handed to vLLM's own kernel."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), *sys.path])}
    r = subprocess.run([sys.executable, "-c", _ENGINE_SCRIPT], capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"inside": [True, True], "padding_untouched": True, "prefill_to_vllm": [2]}


def test_the_device_probe_runs_its_kernels_and_checks_them(tmp_path):
    """benchmarks/kv_decode_gpu.py end to end in the interpreter (vLLM's kernels need a GPU: they are reported as
    not run, not timed): the split-KV rows for both caches, each checked against the kernel's own default launch."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    out = tmp_path / "kvd.json"
    r = subprocess.run([sys.executable, "benchmarks/kv_decode_gpu.py", "--seqs", "2", "--context", "40", "--no-sweep", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert sorted(row["backend"] for row in rows) == ["jetrl split-KV (bf16 cache)", "jetrl split-KV (e4m3 cache)"]
    assert all(row["rel_err_vs_split_kv"] == 0 and row["value"] > 0 for row in rows)
