"""The bitwise mode's promise with the vLLM engine on a GPU: every sampled token's log-prob is the trainer's, bit for bit.

A bitwise `VLLMEngine` (jetrl_fp8 with bitwise=True; vLLM's default mode, torch.compile + CUDA graphs) samples 16
prompts at T=1; the trainer-side model of the same recipe, converted as the trainer converts it (`convert_to_fp8` +
`make_batch_invariant`, FP8 linears on `triton_invariant`), recomputes the log-probs through the `Actor`, padded and
packed. Recipes bf16 and jet_fp8. Each engine runs in its own process (`vllm_bitwise_job.py`).

The model: SmolLM2-135M-Instruct (hidden 576, GQA, tied embeddings; up to 1024 new tokens) when JETRL_SMOLLM2 names
its BF16 Hugging Face folder; a Llama-3.1-8B-shaped random model with JETRL_BITWISE_8B_LAYERS layers (1024 new tokens
each, EOS ignored; built on the GPU by benchmarks/vllm_gpu.py's make_model_dir); else a tiny random Llama of SmolLM2's
shape family (128 tokens, EOS ignored). JETRL_VLLM_TEST_PROMPTS sets the prompt count (16; 128 or more make the
engine's decode batches reach the vendor route's ROUTE_MIN_M). JETRL_RESULTS_DIR, if set, receives each job's JSON
and log. On failure the message names the sequences and positions that differ and the
first differing position's |dlogp|.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_testutil import require_cuda_and_vllm  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

require_cuda_and_vllm()

HERE = Path(__file__).resolve().parent
RECIPES = ("bf16", "jet_fp8")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, int, bool]:
    """(model folder, new tokens, ignore EOS)."""
    env = os.environ.get("JETRL_SMOLLM2")
    new_tokens = int(os.environ.get("JETRL_VLLM_TEST_NEW_TOKENS", "1024"))
    if env:
        return Path(env), new_tokens, False
    from openrlhf.utils.tiny_model import TinyModelSpec, build_char_tokenizer, build_tiny_model

    layers = int(os.environ.get("JETRL_BITWISE_8B_LAYERS", "0"))
    if layers:
        sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))
        from vllm_gpu import SHAPE, make_model_dir

        path = make_model_dir(tmp_path_factory.mktemp("llama8b") / f"llama8b_l{layers}", layers)
        build_char_tokenizer(SHAPE["vocab_size"]).save_pretrained(path)  # prompts are random ids; vLLM loads one
        return path, new_tokens, True

    # SmolLM2's shape family: hidden 576 (partial FP8 blocks), GQA 9/3 with head_dim 64, tied embeddings
    spec = TinyModelSpec(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=4096, max_position_embeddings=1024, tie_word_embeddings=True,
                         initializer_range=0.2)
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama") / "model", spec, dtype=torch.bfloat16), 128, True


@pytest.fixture(scope="module")
def results(model, tmp_path_factory) -> dict[str, dict]:
    path, new_tokens, ignore_eos = model
    out = Path(os.environ.get("JETRL_RESULTS_DIR") or tmp_path_factory.mktemp("vllm_bitwise"))
    out.mkdir(parents=True, exist_ok=True)
    procs = {}
    for recipe in RECIPES:  # together: compilation is CPU-bound and each engine takes a slice of the GPU
        f = out / f"bitwise_{path.name}_{recipe}.json"
        log = open(f.with_suffix(".log"), "w")
        cmd = [sys.executable, str(HERE / "vllm_bitwise_job.py"), "--model", str(path), "--recipe", recipe,
               "--prompts", os.environ.get("JETRL_VLLM_TEST_PROMPTS", "16"), "--new-tokens", str(new_tokens), "--out", str(f), *(["--ignore-eos"] if ignore_eos else []),
               *(["--gpu-mem", "0.25"] if path.name.startswith("llama8b") else [])]  # 8B-shaped weights: ~5.5 GB at 8 layers
        procs[recipe] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ)), f)
    res = {}
    for recipe, (p, f) in procs.items():
        rc = p.wait(timeout=1200)
        if rc != 0 or not f.exists():
            pytest.fail(f"vLLM bitwise job {recipe} exited {rc}:\n{f.with_suffix('.log').read_text()[-4000:]}")
        res[recipe] = json.loads(f.read_text())
    return res


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_engine_logprobs_are_the_trainers_bit_for_bit(results, recipe, layout):
    r = results[recipe]
    assert r["tokens"] >= r["prompts"] * 8, f"{recipe}: only {r['tokens']} sampled tokens for {r['prompts']} prompts"
    d = r[layout]
    assert d["differing_tokens"] == 0, (
        f"{recipe} ({layout} recompute): {d['differing_tokens']} of {d['tokens']} log-probs differ, in sequences "
        f"{d['differing_sequences']} (first differing position per sequence {d['first_position_per_sequence']}); the first "
        f"at sequence {d['first']['sequence']} position {d['first']['position']}: |dlogp| {d['first']['abs_dlogp']:.3g}; "
        f"max |dlogp| {d['max_abs_dlogp']:.3g}"
    )
