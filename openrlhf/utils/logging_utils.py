"""Metric sinks: TensorBoard and wandb (offline works without a key), rank 0 only."""

from __future__ import annotations

import logging
import os
from typing import Any

__all__ = ["MetricsLogger", "setup_logging"]

logger = logging.getLogger(__name__)


def setup_logging(rank: int = 0) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[%(asctime)s rank{rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


class MetricsLogger:
    def __init__(self, *, enabled: bool, tensorboard_dir: str | None = None, wandb_cfg: Any = None, run_config: dict | None = None) -> None:
        self.tb = None
        self.wandb = None
        self.history: list[tuple[int, dict[str, float]]] = []
        if not enabled:
            return
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(tensorboard_dir, exist_ok=True)
            self.tb = SummaryWriter(tensorboard_dir)
        if wandb_cfg is not None and wandb_cfg.enabled:
            try:
                import wandb
            except ImportError:
                raise ImportError("wandb logging was requested but wandb is not installed: pip install wandb") from None
            if wandb_cfg.key and wandb_cfg.mode == "online":
                wandb.login(key=wandb_cfg.key)
            self.wandb = wandb.init(
                project=wandb_cfg.project, name=wandb_cfg.run_name, group=wandb_cfg.group, entity=wandb_cfg.org,
                mode=wandb_cfg.mode, config=run_config or {}, reinit=True,
            )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.history.append((step, dict(metrics)))
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
