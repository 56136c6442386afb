"""What --precision.bitwise saves and costs on CPU. Three GRPO runs of the same model, data and seed:

  proven     --precision.bitwise: the engine's log-probs are used on steps a 2-sequence sample proves them exact
  recompute  --precision.bitwise --precision.bitwise_check_samples 0: the same numerics, every sequence recomputed
  ordinary   the recipe without the mode (sdpa attention, MKL linears): what the batch-invariant numerics cost here

The trainers live in one process and are stepped in turn; the first step of each is a warm-up and is not
counted. `proven` and `recompute` sample the same responses and must produce the same losses every step (the proof
makes the skipped recompute a no-op), which the script checks before it reports. Besides the trainer's wall-clock
phases it measures each step's process CPU time, which other jobs on a shared machine do not inflate; `ordinary`
samples other responses (other numerics), so its cost is compared per response token.

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
import time
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
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time without OpenMP spin-waits)")
    p.add_argument("--record", action="store_true", help="write a run record to benchmarks/results/runs")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import torch

    torch.set_num_threads(a.threads)

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
    times: dict[str, dict[str, list[float]]] = {n: {k: [] for k in (*KEYS, "cpu_s", "cpu_s_per_token")} for n in trainers}
    for step in range(a.steps + 1):
        ms = {}
        for n, tr in trainers.items():
            c0 = time.process_time()
            ms[n] = tr.step().metrics
            ms[n]["cpu_s"] = time.process_time() - c0
            ms[n]["cpu_s_per_token"] = ms[n]["cpu_s"] / max(ms[n]["rollout/total_response_tokens"], 1.0)
        if ms["proven"]["train/policy_loss"] != ms["recompute"]["train/policy_loss"]:
            raise SystemExit(f"step {step}: the two runs' losses differ; the proof is broken, no figures reported")
        if ms["proven"]["bitwise/engine_logprobs_used"] != 1.0:
            raise SystemExit(f"step {step}: the proof did not hold ({json.dumps({k: v for k, v in ms['proven'].items() if k.startswith('bitwise/')})})")
        if step == 0:
            continue  # warm-up
        for n, m in ms.items():
            for k in times[n]:
                times[n][k].append(m[k])
        print(f"step {step}: " + "  ".join(
            f"{n} {ms[n]['perf/step_s']:.2f}s wall, {ms[n]['cpu_s']:.2f}s cpu (old logprobs {ms[n]['perf/old_logprob_s']:.3f}s, "
            f"{ms[n]['rollout/total_response_tokens']:.0f} tokens)" for n in ms))
    for tr in trainers.values():
        tr.close()
    med = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    # proven and recompute do the same work but for the skipped recompute: CPU time measures the saving.
    saving = 1 - med["proven"]["cpu_s"] / med["recompute"]["cpu_s"]
    wall_saving = 1 - med["proven"]["perf/step_s"] / med["recompute"]["perf/step_s"]
    phase_saving = (med["recompute"]["perf/old_logprob_s"] - med["proven"]["perf/old_logprob_s"]) / med["recompute"]["perf/step_s"]
    cost = med["recompute"]["cpu_s_per_token"] / med["ordinary"]["cpu_s_per_token"]
    shape = (f"{'tiny Llama hidden ' + str(a.hidden) + ' x ' + str(a.layers) + ' layers' if not a.model else Path(a.model).name}, "
             f"fp32, {a.recipe}, 16 prompts x 8 samples x {a.max_new_tokens} tokens, ZeRO-0, 1 rank")
    print(json.dumps({"median": med, "step_cpu_time_saving": saving, "step_wall_time_saving": wall_saving,
                      "old_logprob_phase_share_of_wall_step": phase_saving,
                      "bitwise_numerics_cpu_per_token_over_ordinary": cost}, indent=1))
    if not a.record:
        return
    from headline import write_run

    date = datetime.date.today().isoformat()
    cmd = "python benchmarks/bitwise_cpu.py " + " ".join(sys.argv[1:])
    dev = f"x86-64 CPU ({torch.get_num_threads()} threads)"
    base = dict(shape=shape, backend=f"{a.recipe}+bitwise", command=cmd, date=date, device=dev, ratio_vs_bf16=None,
                steps=a.steps, median=med)
    records = [
        dict(base, name="bitwise_step_cpu_time_saving", value=saving, unit="fraction of the recomputing step's CPU time",
             wall_time_saving=wall_saving, old_logprob_phase_share_of_wall_step=phase_saving),
        dict(base, name="bitwise_old_logprob_seconds", value=med["proven"]["perf/old_logprob_s"], unit="s",
             recompute_old_logprob_seconds=med["recompute"]["perf/old_logprob_s"]),
        dict(base, name="bitwise_cpu_numerics_cost", value=cost, unit="x ordinary CPU seconds per response token"),
    ]
    print(f"wrote {write_run(records, 'bitwise-cpu', date)}")


if __name__ == "__main__":
    main()
