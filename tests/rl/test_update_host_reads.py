"""The actor update reads nothing back from the device between optimizer steps.

A host read (`.item()`, `float(t)`, `bool(t)`) of a GPU tensor waits for every queued kernel; the next kernels then
start from an empty queue. Per micro-step that cost ~20 ms of GPU idle time at 16 layers, more with FP8, whose
kernels are shorter. Counted on CPU, where every such read still passes through torch's function overrides; the
host-to-device copies of the micro-batches are checked on a GPU (tests/gpu/test_update_host_reads_gpu.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from _rl_helpers import grpo_args

pytestmark = pytest.mark.integration

_READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.tolist}
_OURS = tuple(str(Path(__file__).resolve().parents[2] / d) for d in ("openrlhf", "jetrl_precision"))


class _CountReads(TorchFunctionMode):
    """Host reads of tensors made by the project's own code (DeepSpeed's are its business)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READS:
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(_OURS):
                self.sites.append(f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno} {func.__name__}")
        return func(*args, **(kwargs or {}))


def _trainer(task, out: Path, *extra: str):
    from openrlhf.config import parse_config
    from openrlhf.trainer.ppo_trainer import PPOTrainer
    from openrlhf.trainer.run import make_engine_factory, make_strategy

    model, data = task
    cfg = parse_config(grpo_args(model, data, out, "jet_fp8", 1, ["--ckpt.save_steps", "-1", *extra]))
    st = make_strategy(cfg)
    st.setup_distributed()
    tr = PPOTrainer(cfg, st, make_engine_factory(cfg, st))
    tr.setup()
    return tr


def test_micro_steps_read_nothing_back_between_optimizer_steps(task, tmp_path):
    # 128 samples per rollout, 4 optimizer steps of 32, micro-batches of 4: 8 micro-steps per optimizer step.
    tr = _trainer(task, tmp_path / "o", "--train.micro_batch_size", "4")
    per_step: list[list[str]] = []
    inner = tr._actor_micro_step

    def counted(*args, **kwargs):
        boundary = tr.actor_engine.is_gradient_accumulation_boundary()
        with _CountReads() as mode:
            out = inner(*args, **kwargs)
        per_step.append((boundary, mode.sites))
        return out

    tr._actor_micro_step = counted
    result = tr.step()
    assert len(per_step) == 32
    between = [sites for boundary, sites in per_step if not boundary]
    assert len(between) == 28 and all(not s for s in between), [s for s in between if s][:3]
    # At the boundary, once per optimizer step: the loss-finiteness check before the step, and after it the gradient
    # norm (read by the health check and for the log).
    at_boundary = [sites for boundary, sites in per_step if boundary]
    assert len(at_boundary) == 4 and all(len(s) <= 3 for s in at_boundary), at_boundary
    m = result.metrics
    assert all(isinstance(m[k], float) for k in ("train/policy_loss", "train/clip_frac", "train/ratio_mean"))
    assert torch.isfinite(torch.tensor(m["train/policy_loss"]))


def test_a_nonfinite_policy_loss_stops_before_its_optimizer_step(task, tmp_path):
    from openrlhf.trainer.health import TrainingDivergedError

    tr = _trainer(task, tmp_path / "o", "--train.micro_batch_size", "4")
    loss_fn = tr.policy_loss
    calls = [0]

    def poisoned(*args, **kwargs):  # the third micro-step of the first optimizer step goes NaN
        out = loss_fn(*args, **kwargs)
        calls[0] += 1
        if calls[0] == 3:
            out.token_loss = out.token_loss * float("nan")
        return out

    tr.policy_loss = poisoned
    before = {n: p.detach().clone() for n, p in tr.actor_engine.module.named_parameters()}
    applied = [0]
    step = tr.actor_engine.step

    def counted_step(*a, **k):
        step(*a, **k)
        applied[0] += int(tr.actor_engine.was_step_applied())

    tr.actor_engine.step = counted_step
    with pytest.raises(TrainingDivergedError, match="non-finite policy loss at step 0"):
        tr.step()
    # Raised at the boundary of the poisoned optimizer step, before DeepSpeed applied it: the weights are untouched.
    assert calls[0] == 8 and applied[0] == 0
    after = dict(tr.actor_engine.module.named_parameters())
    assert all(torch.equal(before[n], after[n].detach()) for n in before)
