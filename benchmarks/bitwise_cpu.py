"""What --precision.bitwise saves and costs on CPU. Three GRPO runs of the same model, data and seed:

  proven     --precision.bitwise: the engine's log-probs are used on steps a 2-sequence sample proves them exact
  recompute  --precision.bitwise --precision.bitwise_check_samples 0: the same numerics, every sequence recomputed
  ordinary   the recipe without the mode (sdpa attention, MKL linears): what the batch-invariant numerics cost here

The trainers live in one process and are stepped in turn, so that load from other jobs on the machine falls on
all alike; the first step of each is a warm-up and is not counted. `proven` and `recompute` must produce the same
losses every step (the proof makes the skipped recompute a no-op), which the script checks before it reports.

    python benchmarks/bitwise_cpu.py --steps 6                       # tiny Llama, 16 prompts x 8 samples x 16 tokens
    python benchmarks/bitwise_cpu.py --hidden 512 --layers 4 --steps 6 --record   # + a run record in benchmarks/results/runs
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KEYS = ("perf/step_s", "perf/experience_s", "perf/old_logprob_s", "perf/rollout_s", "perf/train_s")


def _args(model: Path, data: Path, out: Path, a, *extra: str) -> list[str]:
    return [
        "--actor.model_name_or_path", str(model), "--data.prompt_dataset", str(data), "--data.label_key", "label",
        "--data.max_len", str(a.max_new_tokens + 24), "--precision.recipe", a.recipe, "--rollout.engine", "hf",
        "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "8", "--rollout.batch_size", "16",
        "--rollout.max_new_tokens", str(a.max_new_tokens), "--rollout.micro_batch_size", "32", "--train.batch_size", "128",
        "--train.micro_batch_size", "32", "--train.max_steps", str(a.steps + 1), "--algo.kl.init_coef", "0",
        "--ds.param_dtype", "fp32", "--ds.zero_stage", "0", "--ckpt.output_dir", str(out), "--ckpt.save_steps", "-1",
        *extra,
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a local HF folder (default: a tiny Llama built here)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--recipe", default="jet_fp8", choices=["jet_fp8", "bf16"])
    p.add_argument("--max_new_tokens", type=int, default=16)
    p.add_argument("--steps", type=int, default=6, help="measured steps per trainer (after one warm-up step)")
    p.add_argument("--record", action="store_true", help="write a run record to benchmarks/results/runs")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import torch

    from openrlhf.config import parse_config
    from openrlhf.datasets.synthetic import make_arithmetic_records, write_jsonl
    from openrlhf.trainer.ppo_trainer import PPOTrainer
    from openrlhf.trainer.run import make_engine_factory, make_strategy
    from openrlhf.utils.tiny_model import TinyModelSpec, build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bitwise_cpu_"))
    data = work / "arith.jsonl"
    write_jsonl(make_arithmetic_records(256, difficulty=1, seed=0, max_operand=4, operators=("+",)), data)
    model = Path(a.model) if a.model else build_tiny_model(
        work / "model", TinyModelSpec(hidden_size=a.hidden, intermediate_size=3 * a.hidden, num_hidden_layers=a.layers,
                                      num_attention_heads=max(a.hidden // 64, 2), num_key_value_heads=max(a.hidden // 128, 1)))
    trainers = {}
    runs = {"proven": ("--precision.bitwise",), "recompute": ("--precision.bitwise", "--precision.bitwise_check_samples", "0"),
            "ordinary": ()}
    for name, extra in runs.items():
        cfg = parse_config(_args(model, data, work / name, a, *extra))
        st = make_strategy(cfg)
        st.setup_distributed()
        trainers[name] = PPOTrainer(cfg, st, make_engine_factory(cfg, st))
        trainers[name].setup()
    times: dict[str, dict[str, list[float]]] = {n: {k: [] for k in KEYS} for n in trainers}
    for step in range(a.steps + 1):
        ms = {n: tr.step().metrics for n, tr in trainers.items()}
        if ms["proven"]["train/policy_loss"] != ms["recompute"]["train/policy_loss"]:
            raise SystemExit(f"step {step}: the two runs' losses differ; the proof is broken, no figures reported")
        if ms["proven"]["bitwise/engine_logprobs_used"] != 1.0:
            raise SystemExit(f"step {step}: the proof did not hold ({json.dumps({k: v for k, v in ms['proven'].items() if k.startswith('bitwise/')})})")
        if step == 0:
            continue  # warm-up
        for n, m in ms.items():
            for k in KEYS:
                times[n][k].append(m[k])
        print(f"step {step}: " + "  ".join(f"{n} {ms[n]['perf/step_s']:.3f}s (old logprobs {ms[n]['perf/old_logprob_s']:.3f}s)" for n in ms))
    for tr in trainers.values():
        tr.close()
    med = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    saving = 1 - med["proven"]["perf/step_s"] / med["recompute"]["perf/step_s"]
    # The part of the saving that the skipped phase accounts for (robust to load on the other phases).
    phase_saving = (med["recompute"]["perf/old_logprob_s"] - med["proven"]["perf/old_logprob_s"]) / med["recompute"]["perf/step_s"]
    cost = {k: med["proven"][k] / med["ordinary"][k] for k in ("perf/rollout_s", "perf/train_s", "perf/step_s")}
    shape = (f"{'tiny Llama hidden ' + str(a.hidden) + ' x ' + str(a.layers) + ' layers' if not a.model else Path(a.model).name}, "
             f"fp32, {a.recipe}, 16 prompts x 8 samples x {a.max_new_tokens} tokens, ZeRO-0, 1 rank")
    print(json.dumps({"median_s": med, "step_time_saving": saving, "old_logprob_phase_saving": phase_saving,
                      "proven_over_ordinary": cost}, indent=1))
    if not a.record:
        return
    from headline import write_run

    date = datetime.date.today().isoformat()
    cmd = "python benchmarks/bitwise_cpu.py " + " ".join(sys.argv[1:])
    dev = f"x86-64 CPU ({torch.get_num_threads()} threads)"
    base = dict(shape=shape, backend=f"{a.recipe}+bitwise", command=cmd, date=date, device=dev, ratio_vs_bf16=None,
                steps=a.steps, median_s=med)
    records = [
        dict(base, name="bitwise_step_time_saving", value=saving, unit="fraction of the recomputing step",
             old_logprob_phase_saving=phase_saving),
        dict(base, name="bitwise_cpu_cost_ratio", value=cost["perf/step_s"], unit="x the ordinary step",
             rollout_ratio=cost["perf/rollout_s"], train_ratio=cost["perf/train_s"]),
        dict(base, name="bitwise_step_seconds", value=med["proven"]["perf/step_s"], unit="s",
             recompute_step_seconds=med["recompute"]["perf/step_s"]),
        dict(base, name="bitwise_old_logprob_seconds", value=med["proven"]["perf/old_logprob_s"], unit="s",
             recompute_old_logprob_seconds=med["recompute"]["perf/old_logprob_s"]),
    ]
    print(f"wrote {write_run(records, 'bitwise-cpu', date)}")


if __name__ == "__main__":
    main()
