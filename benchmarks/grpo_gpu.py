"""GRPO step-time benchmark on GPUs: bf16 vs jet_fp8, 1 vs N GPUs, SPMD under the deepspeed launcher.

Builds a random-init Llama-architecture model (~0.6B parameters, vocab 32768 so a random
policy rarely samples EOS and rollouts run to full length), a synthetic prompt set, then runs
`deepspeed --num_gpus G openrlhf/cli/train_ppo_ray.py ...` (ZeRO-3, NCCL, transformers
rollout engine) per (recipe, G) and prints one table: step time split into rollout,
old-logprob, reference, actor update and weight quantization+sync, rollout tokens/s, peak
memory per GPU and the rollout-train mismatch. Results go to --out as JSON + markdown.

    python benchmarks/grpo_gpu.py --gpus 1 2 --recipes bf16 jet_fp8 --steps 3 --max_new_tokens 1024 --out $OUT
    (--concurrent_single runs the 1-GPU runs side by side, one GPU each, on a multi-GPU host)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llama_params import llama_params  # noqa: E402  (benchmarks/ is on sys.path: this file runs as a script from there)


def build(workdir: Path, hidden: int, layers: int, inter: int) -> tuple[Path, Path]:
    import torch

    from openrlhf.datasets.synthetic import make_arithmetic_records, write_jsonl
    from openrlhf.utils.tiny_model import TinyModelSpec, build_char_tokenizer, build_tiny_model

    model = workdir / "model"
    if not (model / "config.json").exists():
        spec = TinyModelSpec(
            hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=hidden // 128,
            num_key_value_heads=max(hidden // 512, 1), vocab_size=32768, max_position_embeddings=4096,
        )
        build_tiny_model(model, spec, tokenizer=build_char_tokenizer(spec.vocab_size), dtype=torch.bfloat16)
    data = workdir / "prompts.jsonl"
    write_jsonl(make_arithmetic_records(4096, difficulty=3, seed=0), data)
    return model, data


def start_one(model: Path, data: Path, out: Path, recipe: str, gpus: int, a, gpu_ids: list[int] | None = None, port: int = 29500):
    """Launch one run; `gpu_ids` pins it to those GPUs (deepspeed's --include), so 1-GPU runs can share a host."""
    per_rank_prompts = a.prompts_per_gpu
    args = [
        "--actor.model_name_or_path", str(model), "--data.prompt_dataset", str(data), "--data.label_key", "label",
        "--data.max_len", str(a.max_new_tokens + 64), "--precision.recipe", recipe, "--precision.gemm_backend", a.gemm_backend,
        "--rollout.engine", "hf", "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", str(a.n),
        "--rollout.batch_size", str(per_rank_prompts * gpus), "--rollout.max_new_tokens", str(a.max_new_tokens),
        "--rollout.micro_batch_size", "8", "--train.batch_size", str(per_rank_prompts * gpus * a.n),
        "--train.micro_batch_size", "4", "--train.max_steps", str(a.steps), "--actor.adam.lr", "1e-6",
        "--algo.kl.init_coef", "0.01", "--algo.kl.use_loss", "--algo.kl.estimator", "k3",
        "--ds.zero_stage", "3", "--ds.param_dtype", "bf16", "--actor.gradient_checkpointing_enable",
        "--ckpt.output_dir", str(out), "--ckpt.save_steps", "0",
        "--train.eval_prompts", "0",  # the before/after evaluation would cost more than the timed steps
    ]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    where = ["--include", "localhost:" + ",".join(map(str, gpu_ids))] if gpu_ids else ["--num_gpus", str(gpus)]
    cmd = ["deepspeed", *where, "--master_port", str(port), str(REPO / "openrlhf/cli/train_ppo_ray.py"), *args]
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log.txt", "w")
    # Own process group: a timeout must take the launcher's workers down too, or they keep the port.
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return {"proc": proc, "log": log, "out": out, "recipe": recipe, "gpus": gpus, "t0": time.time()}


def finish_one(job: dict, a) -> dict:
    proc, out, recipe, gpus = job["proc"], job["out"], job["recipe"], job["gpus"]
    try:
        proc.wait(timeout=max(1.0, a.timeout - (time.time() - job["t0"])))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    job["log"].close()
    if proc.returncode != 0:
        return {"recipe": recipe, "gpus": gpus, "error": (out / "log.txt").read_text()[-1500:]}
    hist = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = hist[1:] or hist  # step 1 includes kernel autotuning / allocator warm-up
    avg = lambda k: sum(h.get(k, 0.0) for h in steady) / len(steady)  # noqa: E731
    keys = ["perf/step_s", "perf/rollout_s", "perf/old_logprob_s", "perf/ref_s", "perf/train_s", "perf/weight_sync_s",
            "perf/rollout_tokens_per_s", "perf/peak_mem_gb", "rollout/total_response_tokens",
            "rollout_train_mismatch/abs_logp_diff_mean", "rollout_train_mismatch/abs_logp_diff_max", "rollout_train_mismatch/kl_k3"]
    rec = {"recipe": recipe, "gpus": gpus, "wall_s": time.time() - job["t0"], **{k: avg(k) for k in keys}}
    rec["per_step_mismatch"] = [h["rollout_train_mismatch/abs_logp_diff_mean"] for h in hist]
    # total_response_tokens is counted over all ranks, so this is the whole job's throughput.
    rec["step_tokens_per_s"] = rec["rollout/total_response_tokens"] / rec["perf/step_s"]
    return rec


def n_params(model: Path) -> int:
    cfg = json.loads((model / "config.json").read_text())
    return sum(llama_params(cfg, cfg["num_hidden_layers"]))


PARTS = [("perf/rollout_s", "rollout"), ("perf/old_logprob_s", "old logprob"), ("perf/ref_s", "reference"),
         ("perf/train_s", "actor update"), ("perf/weight_sync_s", "weight quant + sync")]


def plot(records: list[dict], path: Path) -> None:
    """Stacked bars of the step-time split per (recipe, GPUs), tokens/s written on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = sorted((r for r in records if "error" not in r), key=lambda r: (r["gpus"], r["recipe"]))
    labels = [f"{r['recipe']}\n{r['gpus']} GPU" for r in ok]
    fig, ax = plt.subplots(figsize=(1.6 * len(ok) + 3.5, 4.2))
    bottom = [0.0] * len(ok)
    for key, name in PARTS:
        vals = [r.get(key, 0.0) for r in ok]
        ax.bar(labels, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    other = [r["perf/step_s"] - b for r, b in zip(ok, bottom)]
    ax.bar(labels, other, bottom=bottom, label="other (reward, advantages, logging)", color="lightgrey")
    for i, r in enumerate(ok):
        ax.text(i, r["perf/step_s"] * 1.01, f"{r['step_tokens_per_s']:.0f} tok/s", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("seconds per GRPO step")
    ax.set_ylim(0, max(r["perf/step_s"] for r in ok) * 1.15)
    ax.set_title("GRPO step split on H200s (ZeRO-3, NCCL, transformers rollout engine)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, nargs="+", default=[1])
    p.add_argument("--recipes", nargs="+", default=["bf16", "jet_fp8"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--max_new_tokens", type=int, default=1024)
    p.add_argument("--prompts_per_gpu", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--inter", type=int, default=4096)
    p.add_argument("--gemm_backend", default="auto")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--stop_on_error", action="store_true")
    p.add_argument("--concurrent_single", action="store_true", help="run the 1-GPU runs of all recipes at once, one GPU each")
    p.add_argument("--workdir", default="/tmp/grpo_gpu")
    p.add_argument("--out", default=os.environ.get("OUT", "grpo_gpu_out"))
    p.add_argument("--plot", default=None, help="also write the step-split bar chart to this PNG")
    p.add_argument("--plot_from", nargs="+", default=None, help="only plot: read records from these grpo_gpu.jsonl files")
    a = p.parse_args()
    if a.plot_from:
        plot([json.loads(line) for f in a.plot_from for line in Path(f).read_text().splitlines() if line.strip()], Path(a.plot or "grpo_step_split.png"))
        return
    work, out = Path(a.workdir), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model, data = build(work, a.hidden, a.layers, a.inter)
    print(f"model: {n_params(model) / 1e9:.2f}B parameters ({a.layers} layers, hidden {a.hidden}, mlp {a.inter})", flush=True)
    records = []

    def record(rec: dict, run_dir: Path) -> None:
        print(json.dumps(rec), flush=True)
        records.append(rec)
        with open(out / "grpo_gpu.jsonl", "a") as f:  # incremental: survives a timeout
            f.write(json.dumps(rec) + "\n")
        if "error" in rec:
            (out / f"log_{rec['recipe']}_{rec['gpus']}gpu.txt").write_text((run_dir / "log.txt").read_text())

    for g in a.gpus:
        if g == 1 and a.concurrent_single:
            # One recipe per GPU at once: each run still has a GPU to itself (the host's cores are shared,
            # as they are between the ranks of a multi-GPU run).
            jobs = [start_one(model, data, work / f"{r}_1gpu", r, 1, a, gpu_ids=[i], port=29600 + i) for i, r in enumerate(a.recipes)]
            for job in jobs:
                record(finish_one(job, a), job["out"])
            continue
        for r in a.recipes:
            job = start_one(model, data, work / f"{r}_{g}gpu", r, g, a, port=29500 + g)
            rec = finish_one(job, a)
            record(rec, job["out"])
            if "error" in rec and a.stop_on_error:
                break
    (out / "grpo_gpu.json").write_text(json.dumps(records, indent=1))
    cols = ["recipe", "gpus", "perf/step_s", "perf/rollout_s", "perf/old_logprob_s", "perf/ref_s", "perf/train_s",
            "perf/weight_sync_s", "step_tokens_per_s", "perf/rollout_tokens_per_s", "perf/peak_mem_gb",
            "rollout_train_mismatch/abs_logp_diff_mean", "rollout_train_mismatch/kl_k3"]
    lines = ["| " + " | ".join(c.split("/")[-1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for rec in records:
        if "error" in rec:
            lines.append(f"| {rec['recipe']} | {rec['gpus']} | ERROR: {rec['error'][-200:]!r} |")
            continue
        lines.append("| " + " | ".join(f"{rec[c]:.4g}" if isinstance(rec[c], float) else str(rec[c]) for c in cols) + " |")
    table = "\n".join(lines)
    (out / "grpo_gpu.md").write_text(table + "\n")
    print(table)
    if a.plot:
        plot(records, Path(a.plot))


if __name__ == "__main__":
    main()
