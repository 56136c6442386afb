"""A short supervised warm start, so a tiny random model has a learning signal for RL.

GRPO needs some correct samples per group; a randomly initialised model has none. A few
hundred SFT steps on (prompt, answer) pairs bring a tiny model to partial accuracy, from
where RL measurably improves it. Loss is on the answer tokens (and EOS) only.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import torch

__all__ = ["sft_warmstart"]

logger = logging.getLogger(__name__)


def sft_warmstart(
    model_dir: str | Path,
    records: list[dict],
    out_dir: str | Path,
    *,
    steps: int = 300,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    input_key: str = "input",
    label_key: str = "label",
) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    pairs = [
        (tok(r[input_key], add_special_tokens=False)["input_ids"], tok(r[label_key], add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
        for r in records
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / steps))
    t0 = time.perf_counter()
    for step in range(steps):
        batch = [pairs[rng.randrange(len(pairs))] for _ in range(batch_size)]
        width = max(len(p) + len(a) for p, a in batch)
        ids = torch.full((batch_size, width), tok.pad_token_id, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        mask = torch.zeros_like(ids)
        for i, (p, a) in enumerate(batch):
            seq = p + a
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, len(p) : len(seq)] = torch.tensor(a)
            mask[i, : len(seq)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if (step + 1) % 50 == 0 or step == steps - 1:
            rate = (step + 1) / (time.perf_counter() - t0)
            logger.info("sft warm start %d/%d loss %.3f (%.1f it/s, eta %.0fs)", step + 1, steps, loss.item(), rate, (steps - step - 1) / rate)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir
