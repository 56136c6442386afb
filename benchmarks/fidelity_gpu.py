"""Accuracy at small scale: rollout-train mismatch against rollout length, and GRPO learning, per precision recipe.

    python benchmarks/fidelity_gpu.py mismatch --model SMOLLM2_DIR --out DIR   # |dlogp| and k3 KL by position, 1k/4k/8k rollouts
    python benchmarks/fidelity_gpu.py learn --model SMOLLM2_DIR --out DIR      # GRPO from one start, 4 runs side by side
    python benchmarks/fidelity_gpu.py long --model SMOLLM2_DIR --out DIR       # the same with >= 4k-token rollouts
    python benchmarks/fidelity_gpu.py report --from DIR [DIR ...]              # run records, plots, headline figures
    python benchmarks/fidelity_gpu.py all --tiny --out DIR                     # every part on CPU with a tiny model

- mismatch: for each row (bf16, fp8_rollout, jet_fp8, jet_fp8+bitwise) one process builds the recipe's trainer model
  and rollout engine (vLLM in its default mode: torch.compile + CUDA graphs), syncs the trainer's weights into the
  engine as a run does, samples chat prompts at T=1 to exactly 1k, 4k and 8k tokens (`ignore_eos`: an instruct model
  answers arithmetic in a few hundred tokens; the length is what is studied) and recomputes every sampled token's
  logprob with the trainer. It reports, by position bucket, the mean and p99 of |logp_engine - logp_trainer| and the
  k3 KL estimate. The bitwise row runs `--precision.bitwise`: vLLM's bitwise mode on CUDA, the transformers engine
  with batch-invariant numerics elsewhere (`--bitwise_engine`); where the mode is unavailable the row records why.
- learn: GRPO on generated arithmetic word problems (math-verify reward; `--task`, TASKS: the default `add_sub_10` is
  calibrated so that the base model solves about a quarter at T=1), one `train_ppo_ray` run per recipe under the
  deepspeed launcher (benchmarks/train_runs.py), all from the same model, data and seed: bf16, jet_fp8 (`--fp8_unified`),
  fp8_rollout (BF16 training, FP8 rollout, no correction: the paper's off-policy baseline) and fp8_rollout with TIS.
  The runs go side by side on the one GPU (a 135M model leaves it mostly idle), each engine starting once the
  previous one is up (vLLM sizes its KV cache from the memory it sees free while it starts). Every run evaluates a
  held-out set every `--eval_every` steps with `--eval_n` samples per prompt (the spread over those resamples is
  `eval/pass1_resample_std`) and logs reward, mismatch and gradient norm every step.
- long: the learning comparison for fp8_rollout without TIS against jet_fp8 on the learn task, with every rollout
  sampled to `--long_tokens` tokens past the model's end of turn (`--rollout.ignore_eos`): the answer, then a long
  tail that the policy gradient covers as it covers long reasoning. The reward reads the first answer
  (benchmarks/first_answer_reward.py); the evaluation samples stop at EOS as usual.
- report: run records in benchmarks/results/runs (benchmarks/headline.py format), `docs/fidelity_mismatch.png`,
  `docs/fidelity_learning.png`, `docs/fidelity_long.png`, a markdown table; the headline figures
  `grpo_eval_gap_jet_fp8_vs_bf16_pct` and `grpo_eval_gap_fp8_rollout_vs_bf16_pct` come from its records.
- `--tiny`: the same code on CPU with a tiny random Llama (openrlhf.utils.tiny_model) and toy sizes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from openrlhf.utils.process import exit_after_run  # noqa: E402
from train_runs import cuda, env_info, finish, free_port, start, wait_engine_ready  # noqa: E402  benchmarks/

ROWS = ("bf16", "fp8_rollout", "jet_fp8", "jet_fp8+bitwise")  # mismatch
RUNS = ("bf16", "jet_fp8", "fp8_rollout", "fp8_rollout_tis")  # learn
LONG_RUNS = ("fp8_rollout", "jet_fp8")
COLORS = {"bf16": "tab:blue", "jet_fp8": "tab:green", "fp8_rollout": "tab:red", "fp8_rollout_tis": "tab:orange",
          "jet_fp8+bitwise": "tab:purple"}
ONE = "{}\nSolve it step by step, then finish with: The answer is <number>."
MISMATCH_KEY = "rollout_train_mismatch/abs_logp_diff_mean"


@dataclass(frozen=True)
class WordTask:
    """A word-problem distribution (openrlhf.datasets.make_word_problem_records) and the chat that asks for it."""

    description: str
    steps: tuple[int, ...] = (1, 2)
    max_number: int = 30
    kinds: tuple[str, ...] | None = None  # one-operation stories drawn from (None: all)
    template: str = "{}"  # the user turn, "{}" the problem
    shots: tuple[tuple[str, str], ...] = ()  # solved examples, as earlier user and assistant turns

    def messages(self, problem: str) -> list[dict]:
        turns = [t for q, a in self.shots for t in ({"role": "user", "content": self.template.format(q)}, {"role": "assistant", "content": a})]
        return turns + [{"role": "user", "content": self.template.format(problem)}]


_SHOTS = (("Tom has 9 apples. Sam gives Tom 4 more. How many apples does Tom have now?", "9 + 4 = 13. The answer is 13."),
          ("Lily has 8 pens and gives 3 of them away. How many pens does Lily have left?", "8 - 3 = 5. The answer is 5."))
# The learning task is calibrated so that SmolLM2-135M-Instruct solves a fair share at T=1 (docs/fidelity.md gives the
# measured rates): GRPO learns only from groups whose rewards differ, and on `mixed_30` the model's ~5% left most
# groups all 0.
TASKS = {
    "add_sub_10": WordTask("one addition or subtraction (gets b more / gives b away), numbers 2..10, two solved examples as "
                           "earlier chat turns", steps=(1,), max_number=10, kinds=("add", "sub"), shots=_SHOTS),
    "mixed_30": WordTask("arithmetic word problems (1-2 operations, numbers up to 30), asked step by step", template=ONE),
}


def _log(msg: str) -> None:
    print(f"[fidelity {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- plans ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MismatchPlan:
    lengths: tuple[int, ...] = (1024, 4096, 8192)
    prompts: int = 16
    n: int = 2  # samples per prompt: 32 rollouts per length
    bucket: int = 256  # position bucket width (tokens)
    engine: str = "vllm"  # vllm | hf, for the rows without --precision.bitwise
    gemm_backend: str = "torch"  # cuBLASLt blockwise on both sides (auto may JIT-build DeepGEMM for minutes in the engine)
    gpu_mem: float = 0.12
    kv_gib: float = 8.0  # fixed KV cache: engines starting together do not size theirs off each other
    recompute_micro: int = 2  # sequences per trainer forward
    # The bitwise row's engine: auto is vLLM's bitwise mode on CUDA (tests/gpu/test_vllm_bitwise_gpu.py) and the
    # transformers engine elsewhere (vLLM's bitwise mode runs the trainer's Triton kernels, CUDA only).
    bitwise_engine: str = "auto"
    bitwise_max_tokens: int = 1024  # the transformers engine decodes without CUDA graphs: shorter rollouts
    timeout: float = 420.0
    tiny: bool = False


@dataclass(frozen=True)
class LearnPlan:
    steps: int = 50
    prompts: int = 16
    n: int = 8
    new_tokens: int = 128  # add_sub_10's answers take ~35 tokens; the rambles the cap cuts are wrong anyway
    prompt_budget: int = 256  # prompt tokens (add_sub_10's two examples and problem: ~150); --data.max_len adds new_tokens
    # Long rollouts: every response sampled to new_tokens past EOS, and a reward that reads its first answer.
    ignore_eos: bool = False
    reward_file: str | None = None
    task: str = "add_sub_10"  # a TASKS key
    max_number: int | None = None  # overrides the task's operand bound
    train_micro: int = 32  # four runs' trainers and engines share the GPU's memory
    # The old-logprob pass holds a micro-batch's logits (64 x 384 tokens x 49152 vocab: 2.4 GB in bf16, twice that
    # upcast): 128 sequences per pass would double it in each of the four runs side by side.
    rollout_micro: int = 64
    # On CPU with these batches, add_sub_10's reward rose 0.16 -> 0.70 in 5 steps and 0.80 by step 7 at 1e-5 (at 2e-5,
    # 3 prompts a step: ~0.9 by step 8, then drift). 5e-6 spreads the rise over more of the 50 steps, where the
    # recipes can differ, instead of 40 steps at the ceiling.
    lr: float = 5e-6
    kl_coef: float = 0.001
    eval_every: int = 10
    eval_prompts: int = 64
    eval_n: int = 8  # resamples per held-out prompt: pass@1 and its spread over resamples
    eval_temperature: float = 0.6
    engine: str = "vllm"
    # 14 GB on an H200: SmolLM2 and its KV cache need ~2 GB; the rest is margin, since vLLM counts what neighbours
    # allocate while it profiles its start-up as its own use
    gpu_mem: float = 0.1
    # A fixed KV cache: vLLM then does not size it from a profile of free memory, which fails when a neighbouring
    # run allocates or frees meanwhile (runs start and finish side by side on one GPU).
    kv_gib: float = 4.0
    gemm_backend: str = "torch"
    concurrent: bool = True
    timeout: float = 520.0
    tiny: bool = False

    def argv(self, model: Path, data: Path, heldout: Path, seed: int) -> list[str]:
        batch = self.prompts * self.n
        argv = [
            "--actor.model_name_or_path", str(model), "--data.prompt_dataset", str(data), "--data.input_key", "input",
            "--data.label_key", "label", "--data.max_len", str(self.new_tokens + self.prompt_budget),
            "--rollout.batch_size", str(self.prompts), "--rollout.n_samples_per_prompt", str(self.n),
            "--rollout.max_new_tokens", str(self.new_tokens), "--rollout.temperature", "1.0",
            "--rollout.micro_batch_size", str(self.rollout_micro), "--rollout.engine", self.engine,
            "--train.batch_size", str(batch), "--train.micro_batch_size", str(math.gcd(self.train_micro, batch)),
            "--train.max_steps", str(self.steps), "--train.seed", str(seed), "--train.colocate_all", "--train.eval_prompts", "0",
            "--actor.adam.lr", str(self.lr), "--actor.lr_scheduler", "constant", "--actor.lr_warmup_ratio", "0",
            "--algo.advantage.estimator", "group_norm", "--algo.kl.use_loss", "--algo.kl.estimator", "k3",
            "--algo.kl.init_coef", str(self.kl_coef), "--ds.zero_stage", "2",
            "--vllm.gpu_memory_utilization", str(self.gpu_mem), "--precision.gemm_backend", self.gemm_backend,
            "--eval.dataset", str(heldout), "--eval.steps", str(self.eval_every), "--eval.n_samples_per_prompt", str(self.eval_n),
            "--eval.temperature", str(self.eval_temperature), "--ckpt.best_metric_key", "none", "--ckpt.save_steps", "0",
        ]
        if not self.tiny and self.engine == "vllm":
            argv += ["--vllm.kv_cache_memory_gib", str(self.kv_gib)]
        if not self.tiny:  # SmolLM2-Instruct: the records hold chat turns; the tiny character model has no chat template
            argv += ["--data.apply_chat_template"]
        if self.ignore_eos:
            argv += ["--rollout.ignore_eos"]
        if self.reward_file:
            argv += ["--reward.remote_url", self.reward_file]
        if not self.concurrent and self.engine == "vllm":
            # Side by side, a sleeping engine would give memory back while a neighbour's vLLM profiles its start-up.
            argv += ["--vllm.enable_sleep"]
        return argv

    def shape(self, model_name: str) -> str:
        length = (f"{self.new_tokens} tokens each (sampled past EOS; the reward reads the first answer)" if self.ignore_eos
                  else f"<={self.new_tokens} tokens")
        return (f"{model_name}, {self.task}: {TASKS[self.task].description}, {self.prompts} prompts x {self.n} samples x {length}, "
                f"lr {self.lr:g}, {self.steps} steps, held-out {self.eval_prompts} prompts x {self.eval_n} samples at "
                f"T={self.eval_temperature:g}, math-verify reward")


def run_argv(run: str) -> list[str]:
    """The flags that make a run one recipe: bf16, jet_fp8 (--fp8_unified), fp8_rollout without or with TIS."""
    if run == "jet_fp8":
        return ["--fp8_unified"]
    argv = ["--precision.recipe", "fp8_rollout" if run.startswith("fp8_rollout") else run]
    if run == "fp8_rollout_tis":
        argv += ["--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type", "tis"]
    return argv


# ---- models and data ----------------------------------------------------------------------------------
def tiny_model(work: Path) -> Path:
    from openrlhf.utils.tiny_model import TinyModelSpec, build_tiny_model

    out = work / "tiny_llama"
    if (out / "config.json").exists():
        return out
    # Peaky next-token distributions (a larger init) make FP8 rounding visible in the logprobs, as in a trained model.
    return build_tiny_model(out, TinyModelSpec(initializer_range=0.1, max_position_embeddings=1024, seed=3))


def word_records(n: int, seed: int, max_number: int = 30, task: WordTask = TASKS["mixed_30"]) -> list[dict]:
    from openrlhf.datasets.synthetic import make_word_problem_records

    return make_word_problem_records(n, seed=seed, max_number=max_number, steps=task.steps, kinds=task.kinds)


def learn_records(plan: LearnPlan, n: int, seed: int) -> list[dict]:
    """The plan's problems; for a chat model each input is the task's chat turns (examples, then the problem)."""
    task = TASKS[plan.task]
    recs = word_records(n, seed, plan.max_number or task.max_number, task)
    if plan.tiny:  # a character model: the bare problem
        return recs
    return [{**r, "input": task.messages(r["input"]), "problem": r["input"]} for r in recs]


def learn_inputs(work: Path, plan: LearnPlan, tag: str) -> tuple[Path, Path]:
    from openrlhf.datasets.synthetic import write_jsonl

    held = learn_records(plan, plan.eval_prompts, 1)  # another seed, and no problem of it among the training ones
    seen = {json.dumps(r["input"]) for r in held}
    need = plan.prompts * (plan.steps + 2)
    train = [r for r in learn_records(plan, need + plan.eval_prompts, 0) if json.dumps(r["input"]) not in seen][:need]
    return write_jsonl(train, work / f"{tag}_train.jsonl"), write_jsonl(held, work / f"{tag}_heldout.jsonl")


def chat_prompt_ids(tokenizer, n: int, seed: int, chat: bool) -> list[list[int]]:
    texts = [ONE.format(r["input"]) for r in word_records(n, seed)]
    if chat:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True) for t in texts]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


# ---- mismatch: one row in its own process -----------------------------------------------------------------
def position_stats(rollout_lp, train_lp, mask, width: int) -> dict:
    """Per position bucket of `width` tokens: mean and p99 of |dlogp|, mean k3 KL estimate, token count."""
    import torch

    d = (train_lp - rollout_lp).double()
    pos = torch.arange(d.shape[1]).expand_as(d)
    out = {"start": [], "abs_mean": [], "abs_p99": [], "kl_k3": [], "tokens": []}
    for lo in range(0, d.shape[1], width):
        sel = mask.bool() & (pos >= lo) & (pos < lo + width)
        x = d[sel]
        if x.numel() == 0:
            continue
        out["start"].append(lo)
        out["abs_mean"].append(x.abs().mean().item())
        out["abs_p99"].append(torch.quantile(x.abs(), 0.99).item())
        out["kl_k3"].append((x.exp() - 1 - x).mean().item())
        out["tokens"].append(int(x.numel()))
    return out


def mismatch_job(a: argparse.Namespace, save) -> dict:
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from jetrl_precision import PrecisionGraph, convert_to_fp8, get_recipe, mismatch_metrics
    from jetrl_precision.batch_invariant import CUDA_INVARIANT_GEMM_BACKENDS, BitwiseUnavailable, make_batch_invariant
    from jetrl_precision.weight_sync import iter_sync_tensors
    from openrlhf.models.actor import Actor, load_causal_lm
    from openrlhf.trainer.engines.base import SamplingConfig
    from openrlhf.trainer.ppo_utils.experience_maker import samples_to_tensors

    plan = MismatchPlan(**{**json.loads(a.plan), "lengths": tuple(json.loads(a.plan)["lengths"])})
    row = a.row
    bitwise = row.endswith("+bitwise")
    recipe = get_recipe(row.split("+")[0])
    on_gpu = torch.cuda.is_available()
    # The bitwise row needs an M-invariant FP8 GEMM: float64 emulation on CPU, the fixed-tiling Triton kernel on CUDA.
    invariant_gemm = sorted(CUDA_INVARIANT_GEMM_BACKENDS)[0] if on_gpu else "emulated"
    recipe = dataclasses.replace(recipe, gemm_backend=invariant_gemm if bitwise else plan.gemm_backend)
    dtype, device = (torch.bfloat16, "cuda") if on_gpu else (torch.float32, "cpu")
    attn = "jetrl_invariant" if bitwise else "sdpa"
    bitwise_engine = plan.bitwise_engine if plan.bitwise_engine != "auto" else ("vllm" if on_gpu else "hf")
    engine_kind = bitwise_engine if bitwise else plan.engine
    tok = AutoTokenizer.from_pretrained(a.model)
    prompts = chat_prompt_ids(tok, plan.prompts, seed=2, chat=tok.chat_template is not None)
    positions = getattr(AutoConfig.from_pretrained(a.model), "max_position_embeddings", 1 << 20)
    longest = max(map(len, prompts))
    slow = bitwise and on_gpu and engine_kind == "hf"
    wanted = [n for n in plan.lengths if not slow or n <= plan.bitwise_max_tokens] or [min(plan.lengths)]
    lengths = [min(n, positions - longest) for n in wanted]  # the model's positions bound the longest
    res = {"part": "mismatch", "row": row, "recipe": recipe.name, "bitwise": bitwise, "engine": engine_kind, "model": a.model,
           "mode": "default (torch.compile + CUDA graphs)" if engine_kind == "vllm" and on_gpu else engine_kind,
           "dtype": str(dtype).split(".")[-1], "prompts": plan.prompts, "n": plan.n, "bucket": plan.bucket}
    t0 = time.perf_counter()
    try:
        trainer = convert_to_fp8(load_causal_lm(a.model, dtype, attn).to(device), recipe, side="train").eval()
        trainer.requires_grad_(False)
        if bitwise:
            make_batch_invariant(trainer)
        if engine_kind == "vllm":
            from openrlhf.trainer.engines.vllm_engine import VLLMEngine

            engine = VLLMEngine(
                a.model, recipe, dtype=res["dtype"], seed=0, gpu_memory_utilization=plan.gpu_mem, max_model_len=longest + max(lengths),
                engine_kwargs={"kv_cache_memory_bytes": int(plan.kv_gib * (1 << 30))} if on_gpu else None, bitwise=bitwise,
            )
        else:
            from openrlhf.trainer.engines.hf_engine import HFEngine

            engine = HFEngine(a.model, recipe, dtype=dtype, device=device, attn_implementation=attn, batch_invariant=bitwise)
    except BitwiseUnavailable as e:
        _log(f"{row}: not available: {e}")
        return {**res, "available": False, "reason": str(e)}
    res.update(available=True, start_seconds=round(time.perf_counter() - t0, 1))
    graph = PrecisionGraph.from_dict(engine.precision_graph())
    res["gemm_backends"] = sorted({e.attrs.backend for e in graph.edges if e.attrs.backend})
    engine.update_weights(iter_sync_tensors(trainer, fp8=recipe.syncs_fp8_weights, layout=engine.sync_layout))  # as a run does before each rollout
    actor = Actor(trainer)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    res["lengths"] = {}
    for i, (asked, length) in enumerate(zip(wanted, lengths)):
        t1 = time.perf_counter()
        sampling = SamplingConfig(max_new_tokens=length, temperature=1.0, n=plan.n, seed=11 + i, ignore_eos=True)
        samples = [s for group in engine.generate(prompts, sampling) for s in group]
        gen_s = time.perf_counter() - t1
        exp = samples_to_tensors(samples, pad)
        train_lp = []
        with torch.no_grad():
            for lo in range(0, len(samples), plan.recompute_micro):
                sl = slice(lo, lo + plan.recompute_micro)
                train_lp.append(actor(exp.sequences[sl].to(device), exp.attention_mask[sl].to(device), exp.num_actions).float().cpu())
        train_lp = torch.cat(train_lp)
        mask = exp.action_mask.bool()
        overall = mismatch_metrics(exp.rollout_logprobs, train_lp, mask, bucket_size=plan.bucket)
        overall = {k: v for k, v in overall.items() if not k.startswith("pos_")}
        diff = (train_lp - exp.rollout_logprobs)[mask].double().abs()
        overall["abs_logp_diff_p99"] = torch.quantile(diff, 0.99).item()
        res["lengths"][str(asked)] = {
            "new_tokens": length, "sequences": len(samples), "tokens": int(mask.sum()), "generate_seconds": round(gen_s, 2),
            "overall": overall, "by_position": position_stats(exp.rollout_logprobs, train_lp, mask, plan.bucket),
        }
        _log(f"{row} {length} tokens: mean |dlogp| {overall['abs_logp_diff_mean']:.3e}, p99 {overall['abs_logp_diff_p99']:.3e}, "
             f"k3 {overall['kl_k3']:.3e} ({len(samples)} rollouts, generated in {gen_s:.1f} s)")
        save({**res, "complete": False})  # a job stopped at the deadline keeps the lengths it finished
    engine.shutdown()
    return {**res, "complete": True}


def cmd_mismatch(a: argparse.Namespace, out: Path, deadline: float) -> list[dict]:
    plan = mismatch_plan(a)
    model = tiny_model(Path(a.workdir)) if plan.tiny else smollm2(a)
    procs = {}
    (out / "mismatch").mkdir(parents=True, exist_ok=True)
    _log(f"mismatch: {', '.join(a.rows)}; rollouts of {', '.join(map(str, plan.lengths))} tokens, {plan.prompts} prompts x {plan.n}")
    for row in a.rows:  # each engine in its own process (vLLM keeps its memory until its process ends), all at once
        js = out / "mismatch" / f"{row.replace('+', '_')}.json"
        cmd = [sys.executable, __file__, "job", "--row", row, "--model", str(model), "--plan", json.dumps(dataclasses.asdict(plan)),
               "--json", str(js)]
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        procs[row] = (subprocess.Popen(cmd, env=env, stdout=open(js.with_suffix(".log"), "w"), stderr=subprocess.STDOUT,
                                       start_new_session=True), js)
    results = []
    t0 = time.time()
    for row, (proc, js) in procs.items():
        try:
            proc.wait(timeout=max(1.0, min(plan.timeout - (time.time() - t0), deadline - time.time())))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            _log(f"mismatch {row}: stopped at the time limit" + (" (the lengths it finished are kept)" if js.exists() else ""))
        if js.exists():
            results.append(json.loads(js.read_text()))
        else:  # a failure, not a refusal: keep the row with the log's tail so the report says why
            tail = js.with_suffix(".log").read_text(errors="replace")[-2000:]
            results.append({"part": "mismatch", "row": row, "available": False, "failed": True, "rc": proc.returncode,
                            "reason": f"the job failed (rc {proc.returncode}); log tail: {tail}"})
            _log(f"mismatch {row}: FAILED (rc {proc.returncode}; see {js.with_suffix('.log')})")
    (out / "mismatch.json").write_text(json.dumps(results, indent=1))
    return results


# ---- learn and long: training runs ---------------------------------------------------------------------
def run_group(part: str, runs: list[str], seeds: list[int], plan: LearnPlan, model: Path, data: tuple[Path, Path], out: Path,
              meta: dict, deadline: float) -> list[dict]:
    """Every (run, seed) as its own training process, side by side (or one after another); `<out>/<part>_<run>_s<seed>.json`."""
    names = [(r, s) for s in seeds for r in runs]
    batches = [names] if plan.concurrent else [[x] for x in names]
    results = []
    for batch in batches:
        if deadline - time.time() < 60:
            _log(f"{part}: no time left for {batch}; skipped")
            continue
        jobs = {}
        for i, (r, s) in enumerate(batch):
            if jobs and plan.engine == "vllm":  # the next engine starts once the previous one is up
                wait_engine_ready(jobs[batch[i - 1]], min(300.0, deadline - time.time()))
            _log(f"{part} {r} seed {s}: starting")
            jobs[(r, s)] = start([*plan.argv(model, *data, seed=s), *run_argv(r)], out / part / f"{r}_s{s}", free_port())
        for (r, s), job in jobs.items():
            res = {"part": part, "run": r, "seed": s, **meta, **finish(job, min(plan.timeout, deadline - job["t0"]))}
            ok = res["rc"] == 0 and res["steps"]
            _log(f"{part} {r} seed {s}: {'done' if ok else 'STOPPED' if res['timed_out'] else 'FAILED'} in {res['wall_s']} s, "
                 f"{len(res['steps'])} steps" + ("" if ok else f" (see {job['out'] / 'log.txt'})"))
            (out / f"{part}_{r}_s{s}.json").write_text(json.dumps(res, indent=1))
            results.append(res)
    return results


def cmd_learn(a: argparse.Namespace, out: Path, deadline: float, part: str) -> list[dict]:
    plan = learn_plan(a, long=part == "long")
    work = Path(a.workdir)
    model = tiny_model(work) if plan.tiny else smollm2(a)
    name = "tiny random Llama" if plan.tiny else "SmolLM2-135M-Instruct"
    data = learn_inputs(work, plan, part)
    meta = {"plan": dataclasses.asdict(plan), "shape": plan.shape(name)}
    _log(f"{part}: {meta['shape']}")
    runs = a.runs if part == "learn" else a.long_runs
    return run_group(part, runs, a.seeds, plan, model, data, out, meta, deadline)


def smollm2(a: argparse.Namespace) -> Path:
    if not a.model or not (Path(a.model) / "config.json").exists():
        raise SystemExit("--model must be a SmolLM2-135M-Instruct folder (examples/scripts/prepare_smollm2.py makes one), or use --tiny")
    return Path(a.model)


def mismatch_plan(a: argparse.Namespace) -> MismatchPlan:
    if a.tiny:
        return MismatchPlan(lengths=(32, 64, 128), prompts=2, n=2, bucket=16, engine=a.engine or "hf", gemm_backend="auto", recompute_micro=4,
                            timeout=600.0, tiny=True)
    return MismatchPlan(lengths=tuple(a.lengths), prompts=a.mm_prompts, n=a.mm_n, bucket=a.bucket, engine=a.engine or "vllm",
                        bitwise_engine=a.bitwise_engine,
                        gemm_backend="torch" if cuda() else "auto")


def _long_sampling() -> dict:
    return {"ignore_eos": True, "reward_file": str(ROOT / "benchmarks" / "first_answer_reward.py")}


def learn_plan(a: argparse.Namespace, long: bool) -> LearnPlan:
    engine = a.engine or ("vllm" if cuda() else "hf")
    if a.tiny:
        # Operands up to 5: a random character model sometimes lands on the answer, so rewards and gradients are not all 0.
        return LearnPlan(steps=a.steps or 2, prompts=2, n=8, new_tokens=24 if long else 12, prompt_budget=200, max_number=5,
                         train_micro=8, rollout_micro=8, eval_every=2 if not long else 1, eval_prompts=4, eval_n=2, engine=engine,
                         gemm_backend="auto", concurrent=True, timeout=600.0, tiny=True, **(_long_sampling() if long else {}))
    if long:
        # Micro-batches of 4 sequences: the trainer's logits of one are 4 x 4.3k tokens x 49k vocabulary (1.7 GB in
        # bf16), and two runs share the GPU.
        return LearnPlan(steps=a.long_steps, prompts=8, n=4, new_tokens=a.long_tokens, lr=a.lr, task=a.task, train_micro=4,
                         rollout_micro=4, eval_every=a.long_eval_every, eval_prompts=32, eval_n=4, engine=engine, gpu_mem=0.15,
                         kv_gib=8.0, concurrent=cuda(), timeout=a.run_timeout or LearnPlan.timeout, **_long_sampling())
    return LearnPlan(steps=a.steps or LearnPlan.steps, prompts=a.prompts, n=a.n, new_tokens=a.new_tokens, lr=a.lr, task=a.task,
                     eval_every=a.eval_every, eval_prompts=a.eval_prompts, eval_n=a.eval_n, engine=engine, concurrent=cuda(),
                     timeout=a.run_timeout or LearnPlan.timeout)


# ---- report --------------------------------------------------------------------------------------------
def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _std(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def usable(res: dict) -> bool:
    """A run that finished, or one stopped at its time limit after some steps; other failures are left out."""
    return bool(res.get("steps")) and (res["rc"] == 0 or res["timed_out"])


def final_eval(res: dict, upto: int | None = None) -> tuple[int, float, float | None, int] | None:
    """(step, pass@1, its spread over resamples, resamples) of the last held-out evaluation at or before step `upto`."""
    evals = [s for s in res["steps"] if "eval/pass1" in s and (upto is None or s["step"] <= upto)]
    if not evals:
        return None
    s = evals[-1]
    return s["step"], s["eval/pass1"], s.get("eval/pass1_resample_std"), res["plan"]["eval_n"]


def reference_run(runs: list[dict]) -> str:
    """What a part compares against: bf16, or jet_fp8 where bf16 did not run (the long-rollout comparison)."""
    names = {r["run"] for r in runs}
    return "bf16" if "bf16" in names or "jet_fp8" not in names else "jet_fp8"


def eval_gaps(runs: list[dict]) -> dict[str, dict]:
    """Each run's final held-out pass@1 against the reference run's (`reference_run`) at the same step, in percentage
    points, with the spread: over seeds when there are several, else the standard error from both runs' resamples."""
    by = {}
    for r in runs:
        by.setdefault(r["run"], {})[r["seed"]] = r
    ref = reference_run(runs)
    base = by.get(ref, {})
    out = {}
    for name, seeds in by.items():
        gaps, ses, accs, step = [], [], [], None
        for seed, r in seeds.items():
            b = base.get(seed)
            common = min(max((s["step"] for s in x["steps"] if "eval/pass1" in s), default=0) for x in (r, b)) if b else None
            fe, fb = (final_eval(r, common), final_eval(b, common)) if b else (final_eval(r), None)
            if fe is None:
                continue
            accs.append(fe[1])
            step = fe[0]
            if fb is not None and fb[0] == fe[0]:
                gaps.append(100 * (fe[1] - fb[1]))
                if fe[2] is not None and fb[2] is not None:
                    ses.append(100 * math.sqrt(fe[2] ** 2 / fe[3] + fb[2] ** 2 / fb[3]))
        if not accs:
            continue
        spread, how = (_std(gaps), f"std over {len(gaps)} seeds") if len(gaps) > 1 else (
            (ses[0], "standard error from the eval resamples") if ses else (None, "-"))
        out[name] = {"pass1": _mean(accs), "step": step, "gap_pp": _mean(gaps) if name != ref and gaps else None, "vs": ref,
                     "spread_pp": spread, "spread_is": how, "seeds": len(accs)}
    return out


def last_quarter(values: list) -> float | None:
    xs = [x for x in values if x is not None]
    return _mean(xs[-max(1, math.ceil(len(xs) / 4)):]) if xs else None


def reward_gap_records(runs: list[dict], rec_fields: dict) -> list[dict]:
    """Each recipe's mean training reward over the last quarter of the steps both it and bf16 ran (same seed), minus
    bf16's, in percentage points, averaged over seeds: `grpo_reward_gap_vs_bf16_pp`, the end-to-end issue's learning
    figure (the held-out gaps above are the accuracy study's)."""
    base = {r["seed"]: r for r in runs if r["run"] == "bf16"}
    gaps: dict[str, list[float]] = {}
    for r in runs:
        b = base.get(r["seed"])
        if r["run"] == "bf16" or b is None:
            continue
        common = min(len(r["steps"]), len(b["steps"]))
        mine = last_quarter([s.get("rollout/reward") for s in r["steps"][:common]])
        ref = last_quarter([s.get("rollout/reward") for s in b["steps"][:common]])
        if mine is not None and ref is not None:
            gaps.setdefault(r["run"], []).append(100 * (mine - ref))
    return [{"name": "grpo_reward_gap_vs_bf16_pp", "shape": runs[0]["shape"], "backend": run, "value": round(_mean(g), 2),
             "unit": "pct points", "ratio_vs_bf16": None, "seeds": len(g), "spread_pp": round(_std(g), 2) if len(g) > 1 else None,
             **rec_fields} for run, g in sorted(gaps.items())]


def records_from(results: list[dict], env: dict, command: str) -> list[dict]:
    recs: list[dict] = []
    device, date = env.get("device", "?"), env.get("date", time.strftime("%Y-%m-%d"))

    def rec(name, shape, backend, value, unit, ratio=None, **extra):
        if value is not None:
            recs.append({"name": name, "shape": shape, "backend": backend, "value": value, "unit": unit, "ratio_vs_bf16": ratio,
                         "command": command, "date": date, "device": device, "gpus": 1, **extra})

    for m in (r for r in results if r["part"] == "mismatch"):
        model = Path(m.get("model") or "?").name
        if not m.get("available"):
            rec("fidelity_mismatch_row_available", f"{model}, rollout-train mismatch study", m["row"], 0, "available (1) or not (0)",
                reason=m.get("reason", ""), failed=bool(m.get("failed")))
            continue
        base = next((x for x in results if x["part"] == "mismatch" and x.get("row") == "bf16" and x.get("available")), None)
        for asked, L in m["lengths"].items():
            shape = (f"{model} {m['dtype']}, {m['prompts']} chat prompts x {m['n']} samples x {L['new_tokens']} tokens (ignore_eos), "
                     f"T=1, engine {m['engine']}, {m['mode']}")
            o = L["overall"]
            b = base["lengths"][asked]["overall"]["abs_logp_diff_mean"] if base and asked in base.get("lengths", {}) else None
            rec("fidelity_mismatch_abs_logp_mean", shape, m["row"], o["abs_logp_diff_mean"], "mean |dlogp|",
                o["abs_logp_diff_mean"] / b if b and m["row"] != "bf16" else None, rollout_tokens=int(asked),
                p99=o["abs_logp_diff_p99"], kl_k3=o["kl_k3"], ratio_outside=o.get("ratio_outside_0.8_1.25"), tokens=L["tokens"],
                by_position=L["by_position"], gemm_backends=m.get("gemm_backends"), job_complete=m.get("complete", True))
    for part in ("learn", "long"):
        runs = [r for r in results if r["part"] == part and usable(r)]
        if not runs:
            continue
        gaps = eval_gaps(runs)
        for r in runs:
            st = r["steps"]
            name = f"{r['run']}_s{r['seed']}"
            curves = {
                "reward_curve": [s.get("rollout/reward") for s in st], "mismatch_curve": [s.get(MISMATCH_KEY) for s in st],
                "kl_k3_curve": [s.get("rollout_train_mismatch/kl_k3") for s in st], "grad_norm_curve": [s.get("train/grad_norm") for s in st],
                "response_length_curve": [s.get("rollout/response_length") for s in st],
                "eval_curve": [[s["step"], s["eval/pass1"], s.get("eval/pass1_resample_std")] for s in st if "eval/pass1" in s],
            }
            rec(f"fidelity_{part}_mismatch_abs_logp_mean", r["shape"], name, _mean(curves["mismatch_curve"]), "mean |dlogp|",
                steps=len(st), completed=r["rc"] == 0, wall_s=r["wall_s"], run=r["run"], seed=r["seed"], **curves)
            rec(f"fidelity_{part}_response_length_mean", r["shape"], name, _mean(curves["response_length_curve"]), "tokens",
                response_length_max=max((x for x in curves["response_length_curve"] if x is not None), default=None),
                new_tokens_cap=r["plan"]["new_tokens"])
        if part == "learn":
            recs.extend(reward_gap_records(runs, rec_fields=dict(command=command, date=date, device=device, gpus=1)))
        for run, g in gaps.items():
            shape = runs[0]["shape"]
            rec(f"fidelity_{part}_eval_pass1_final", shape, run, round(g["pass1"], 4), "pass@1", at_step=g["step"], seeds=g["seeds"])
            if g["gap_pp"] is not None:
                rec(f"grpo_{'long_' if part == 'long' else ''}eval_gap_vs_{g['vs']}_pp", shape, run, round(g["gap_pp"], 2), "pct points",
                    spread_pp=None if g["spread_pp"] is None else round(g["spread_pp"], 2), spread_is=g["spread_is"], at_step=g["step"],
                    seeds=g["seeds"])
    return recs


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_mismatch(results: list[dict], path: Path) -> Path | None:
    rows = [m for m in results if m["part"] == "mismatch" and m.get("available")]
    if not rows:
        return None
    plt = _plt()
    lengths = sorted({int(k) for m in rows for k in m["lengths"]})
    fig, axes = plt.subplots(2, len(lengths), figsize=(4.2 * len(lengths) + 3.0, 7), squeeze=False)
    for j, asked in enumerate(lengths):
        for m in rows:
            L = m["lengths"].get(str(asked))
            if not L:
                continue
            bp = L["by_position"]
            c = COLORS.get(m["row"])
            zero = " (exactly 0: drawn at the floor)" if not any(bp["abs_p99"]) else ""
            axes[0][j].plot(bp["start"], [max(v, 1e-9) for v in bp["abs_mean"]], "-", color=c, label=f"{m['row']} mean{zero}")
            axes[0][j].plot(bp["start"], [max(v, 1e-9) for v in bp["abs_p99"]], ":", color=c, label=f"{m['row']} p99")
            axes[1][j].plot(bp["start"], [max(v, 1e-12) for v in bp["kl_k3"]], "-", color=c, label=m["row"])
        axes[0][j].set_title(f"{asked}-token rollouts", fontsize=10)
        axes[1][j].set_xlabel("response position (bucket start)")
        for ax in axes[:, j]:
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("|logp_engine - logp_trainer| (mean, p99)")
    axes[1][0].set_ylabel("k3 KL estimate")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    missing = [m["row"] for m in results if m["part"] == "mismatch" and not m.get("available")]
    name = Path(rows[0]["model"]).name
    name = "SmolLM2-135M-Instruct" if "smol" in name.lower() else name
    engines = ", ".join(sorted({f"{m['row']}: {m['engine']}" for m in rows if m["row"].endswith("+bitwise")}))
    fig.suptitle(f"rollout-train mismatch by position: {name}, {rows[0]['mode']}" + (f" ({engines})" if engines else "")
                 + (f" (not available: {', '.join(missing)})" if missing else ""), fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_learning(results: list[dict], part: str, path: Path) -> Path | None:
    runs = [r for r in results if r["part"] == part and usable(r)]
    if not runs:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 4, figsize=(19, 4))
    for r in sorted(runs, key=lambda r: (r["run"], r["seed"])):
        st = r["steps"]
        steps = [s["step"] for s in st]
        c, label = COLORS.get(r["run"]), f"{r['run']} s{r['seed']}"
        axes[0].plot(steps, [s.get("rollout/reward") for s in st], color=c, alpha=0.8, label=label)
        ev = [(s["step"], s["eval/pass1"], s.get("eval/pass1_resample_std") or 0.0) for s in st if "eval/pass1" in s]
        if ev:
            x, y, e = zip(*ev)
            axes[1].errorbar(x, y, yerr=e, fmt="s-", color=c, capsize=3, label=label)
        axes[2].plot(steps, [max(s.get(MISMATCH_KEY) or 1e-12, 1e-12) for s in st], color=c, label=label)
        axes[3].plot(steps, [s.get("train/grad_norm") for s in st], color=c, label=label)
    for ax, yl in zip(axes, ("mean reward (math-verify)", "held-out pass@1 (bars: std over resamples)",
                             "rollout vs trainer mean |dlogp|", "actor gradient norm")):
        ax.set_xlabel("step")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
    axes[2].set_yscale("log")
    for ax in axes[:2]:  # accuracies: 0 to 1
        ax.set_ylim(-0.02, 1.02)
    axes[0].legend(fontsize=7)
    fig.suptitle(runs[0]["shape"], fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(results: list[dict]) -> str:
    lines = []
    mm = [m for m in results if m["part"] == "mismatch"]
    if mm:
        lengths = sorted({int(k) for m in mm for k in m.get("lengths", {})})
        lines += ["| row | " + " | ".join(f"{n} tok: mean / p99 / k3" for n in lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
        for m in sorted(mm, key=lambda m: ROWS.index(m["row"]) if m["row"] in ROWS else 9):
            if not m.get("available"):
                lines.append(f"| {m['row']} | not available: {m.get('reason', '?').splitlines()[0][:300]} |")
                continue
            cells = []
            for n in lengths:
                o = m["lengths"].get(str(n), {}).get("overall")
                cells.append(f"{o['abs_logp_diff_mean']:.3g} / {o['abs_logp_diff_p99']:.3g} / {o['kl_k3']:.3g}" if o else "-")
            lines.append(f"| {m['row']} | " + " | ".join(cells) + " |")
    for part in ("learn", "long"):
        runs = [r for r in results if r["part"] == part]
        if not runs:
            continue
        gaps = eval_gaps([r for r in runs if usable(r)])
        lines += ["", f"| {part} run | steps | first / last-quarter reward | mean mismatch | mean grad norm | response length | "
                  f"final held-out pass@1 | vs {reference_run(runs)} (pp) |", "|---|---|---|---|---|---|---|---|"]
        for r in sorted(runs, key=lambda r: (r["run"], r["seed"])):
            if not usable(r):
                lines.append(f"| {r['run']} s{r['seed']} | FAILED (rc {r['rc']}) |")
                continue
            st = r["steps"]
            rw = [s.get("rollout/reward") for s in st]
            k = max(1, math.ceil(len(rw) / 4))
            g = gaps.get(r["run"], {})
            fe = final_eval(r, g.get("step"))  # at the step the comparison uses (runs cut short may differ)
            gap = f"{g['gap_pp']:+.1f} ± {g['spread_pp']:.1f}" if g.get("gap_pp") is not None and g.get("spread_pp") is not None else (
                f"{g['gap_pp']:+.1f}" if g.get("gap_pp") is not None else "-")
            mism, gn = _mean([s.get(MISMATCH_KEY) for s in st]), _mean([s.get("train/grad_norm") for s in st])
            lines.append(f"| {r['run']} s{r['seed']} | {len(st)} | {rw[0]:.3f} / {_mean(rw[-k:]):.3f} | {mism:.3g} | "
                         f"{gn if gn is None else f'{gn:.3g}'} | {_mean([s.get('rollout/response_length') for s in st]):.0f} | "
                         f"{f'{fe[1]:.3f} (step {fe[0]})' if fe else '-'} | {gap} |")
    return "\n".join(lines)


def load_results(dirs: list[str]) -> tuple[list[dict], list[dict]]:
    """(results, the env.json of every folder, in order)."""
    results, envs = {}, []
    for d in map(Path, dirs):
        for f in sorted(d.rglob("*.json")):
            if f.name == "env.json":
                envs.append(json.loads(f.read_text()))
                continue
            if f.name == "mismatch.json" or f.parent.name == "mismatch" or not f.name.startswith(("learn_", "long_")):
                continue
            data = json.loads(f.read_text())
            if isinstance(data, dict) and data.get("part") in ("learn", "long"):
                results[(data["part"], data["run"], data["seed"])] = data  # a later call's run replaces an earlier one
        for f in sorted(d.rglob("mismatch.json")):
            for m in json.loads(f.read_text()):
                results[("mismatch", m["row"])] = m
    return list(results.values()), envs


def cmd_report(a: argparse.Namespace) -> None:
    from headline import RUNS as RUNS_DIR, recorded_env, write_run  # benchmarks/headline.py

    results, envs = load_results(a.from_dirs)
    if not results:
        raise SystemExit(f"report: no mismatch.json, learn_*.json or long_*.json under {', '.join(a.from_dirs)}")
    text = table(results)
    if a.table_only:  # on the device: no plotting library needed, records are written where the results come back to
        print(text)
        return
    env = recorded_env(envs, a.device_name, "fidelity_gpu report")
    recs = records_from(results, env, a.command)
    if recs:
        path = write_run(recs, a.label, env.get("date") or time.strftime("%Y-%m-%d"), Path(a.runs_dir) if a.runs_dir else RUNS_DIR)
        print(f"wrote {len(recs)} records to {path}")
    docs = Path(a.docs_dir) if a.docs_dir else ROOT / "docs"
    for p in (plot_mismatch(results, docs / "fidelity_mismatch.png"), plot_learning(results, "learn", docs / "fidelity_learning.png"),
              plot_learning(results, "long", docs / "fidelity_long.png")):
        if p:
            print(f"wrote {p}")
    (Path(a.from_dirs[-1]) / "report.md").write_text(text + "\n")  # beside the newest results it covers
    print(text)


# ---- command line ----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["mismatch", "learn", "long", "report", "all", "job"])
    ap.add_argument("--out", default=os.environ.get("OUT", "fidelity_out"), help="results folder")
    ap.add_argument("--workdir", default="/tmp/fidelity", help="data (and the tiny model)")
    ap.add_argument("--model", default=None, help="SmolLM2-135M-Instruct folder")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: a tiny random Llama, toy sizes")
    ap.add_argument("--engine", default=None, choices=["vllm", "hf"], help="rollout engine (default: vllm on a GPU; hf on CPU)")
    ap.add_argument("--deadline", type=float, default=None, help="seconds from now after which no run starts and runs are stopped")
    ap.add_argument("--run_timeout", type=float, default=None, help="seconds per training run (default 520)")
    mp = ap.add_argument_group("mismatch")
    mp.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    mp.add_argument("--lengths", type=int, nargs="+", default=list(MismatchPlan.lengths))
    mp.add_argument("--mm_prompts", type=int, default=MismatchPlan.prompts)
    mp.add_argument("--mm_n", type=int, default=MismatchPlan.n)
    mp.add_argument("--bucket", type=int, default=MismatchPlan.bucket)
    mp.add_argument("--bitwise_engine", default=MismatchPlan.bitwise_engine, choices=["auto", "hf", "vllm"],
                    help="the jet_fp8+bitwise row's engine (auto: vllm on CUDA, hf elsewhere; vllm's bitwise mode is GPU only)")
    lp = ap.add_argument_group("learn and long")
    lp.add_argument("--runs", nargs="+", default=list(RUNS), choices=RUNS)
    lp.add_argument("--long_runs", nargs="+", default=list(LONG_RUNS), choices=RUNS)
    lp.add_argument("--seeds", type=int, nargs="+", default=[0])
    lp.add_argument("--steps", type=int, default=None, help=f"learn steps (default {LearnPlan.steps})")
    lp.add_argument("--prompts", type=int, default=LearnPlan.prompts)
    lp.add_argument("--n", type=int, default=LearnPlan.n)
    lp.add_argument("--new_tokens", type=int, default=LearnPlan.new_tokens, help="rollout length cap of learn")
    lp.add_argument("--lr", type=float, default=LearnPlan.lr)
    lp.add_argument("--task", default=LearnPlan.task, choices=sorted(TASKS),
                    help="learn's word problems: " + "; ".join(f"{k}: {t.description}" for k, t in TASKS.items()))
    lp.add_argument("--eval_every", type=int, default=LearnPlan.eval_every)
    lp.add_argument("--eval_prompts", type=int, default=LearnPlan.eval_prompts)
    lp.add_argument("--eval_n", type=int, default=LearnPlan.eval_n)
    lp.add_argument("--long_steps", type=int, default=10)
    lp.add_argument("--long_tokens", type=int, default=4096)
    lp.add_argument("--long_eval_every", type=int, default=5)
    rp = ap.add_argument_group("report")
    rp.add_argument("--from", dest="from_dirs", nargs="+", default=None)
    rp.add_argument("--runs_dir", default=None, help="where run records go (default benchmarks/results/runs)")
    rp.add_argument("--docs_dir", default=None, help="where the plots go (default docs/)")
    rp.add_argument("--table_only", action="store_true")
    rp.add_argument("--label", default="fidelity-gpu")
    rp.add_argument("--device_name", default=None, help="the device, for results whose env.json does not name it")
    rp.add_argument("--command", default="bash benchmarks/h200_fidelity.sh (calls in docs/fidelity.md)")
    jp = ap.add_argument_group("job (internal: one mismatch row in this process)")
    jp.add_argument("--row", default=None, choices=ROWS)
    jp.add_argument("--plan", default=None)
    jp.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # FlashInfer is not carried to the lent GPU
    if a.what == "job":
        def save(res: dict) -> None:
            Path(a.json).write_text(json.dumps({**res, "date": time.strftime("%Y-%m-%d")}, indent=1))

        save(mismatch_job(a, save))
        return
    if a.what == "report":
        if not a.from_dirs:
            ap.error("report needs --from DIR")
        cmd_report(a)
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(a.workdir).mkdir(parents=True, exist_ok=True)
    (out / "env.json").write_text(json.dumps(env_info(), indent=1))
    deadline = time.time() + (a.deadline or 1e9)
    if a.what in ("mismatch", "all"):
        cmd_mismatch(a, out, deadline)
    for part in ("learn", "long"):
        if a.what in (part, "all"):
            cmd_learn(a, out, deadline, part)
    if a.what == "all":
        a.from_dirs = [str(out)]
        cmd_report(a)


if __name__ == "__main__":
    main()
    exit_after_run(0)
