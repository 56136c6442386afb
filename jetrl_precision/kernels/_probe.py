"""The verdict of a once-per-key device probe: computed at first use, a failure kept with its reason and logged once."""

from __future__ import annotations

from typing import Callable, Hashable

import torch

__all__ = ["device_key", "verdict_once"]


def device_key(device: torch.device | str) -> str:
    """'cuda' and 'cuda:0' name one GPU when 0 is current; key them the same, or a probe runs twice."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def verdict_once(verdicts: dict, reasons: dict, key: Hashable, check: Callable[[], str], warn: Callable[[str], None]) -> bool:
    """`check()` returns "" when the probe passes, else why it failed; an exception it raises is a failure too (a
    kernel that cannot build or run here is reported, not fatal). `warn(why)` runs once per failing key."""
    if key not in verdicts:
        try:
            why = check()
        except Exception as e:  # noqa: BLE001 - see above
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            why = f"failed to run ({type(e).__name__}: {msg})"
        verdicts[key] = not why
        if why:
            reasons[key] = why
            warn(why)
    return verdicts[key]
