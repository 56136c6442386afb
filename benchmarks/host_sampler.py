"""Where a thread's host time goes, by Python function: a sampling profiler for host-bound loops (an eager engine's
decode steps), cheap enough to leave the loop's shape intact.

    with StackSampler() as s:
        llm.generate(...)
    s.self_us()   # {"vllm/v1/worker/gpu_model_runner.py:execute_model:1234": us, ...}  the innermost frame
    s.cum_us()    # {"vllm/v1/worker/gpu_model_runner.py:GPUModelRunner.execute_model": us, ...}  anywhere on the stack

A background thread reads the sampled thread's stack (`sys._current_frames`) every `interval_s` and charges the time
since its previous read to each function on it. torch.profiler's host events name aten ops but not the Python around
them, and an eager decode step's host time is mostly that Python. Sampling only sees the stack when the sampled
thread lets go of the GIL: time inside a C call that releases it (torch's ops, a synchronize) is charged to the line
that made the call; time inside one that holds it is charged to wherever the thread next lets go (a few bytecodes
on, often the next function entered). The interpreter's switch interval is lowered while sampling, so the sampler gets
the GIL within about one interval of asking rather than the default 5 ms; it is put back on exit.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter

__all__ = ["StackSampler", "frame_key", "per_step"]

_ROOTS = ("site-packages/", "dist-packages/")


def frame_key(filename: str, func: str, line: int | None = None) -> str:
    """`pkg/module.py:func[:line]`, the path cut after site-packages (or to the project's own package)."""
    path = filename.replace("\\", "/")
    for root in _ROOTS:
        if root in path:
            path = path.rsplit(root, 1)[1]
            break
    else:
        for pkg in ("/jetrl_precision/", "/openrlhf/", "/benchmarks/"):
            if pkg in path:
                path = pkg[1:] + path.rsplit(pkg, 1)[1]
                break
    return f"{path}:{func}" + (f":{line}" if line is not None else "")


class StackSampler:
    """Samples one thread's Python stack (the caller's unless `thread_id` is given) until the `with` block ends."""

    def __init__(self, interval_s: float = 0.0005, thread_id: int | None = None, max_depth: int = 80) -> None:
        if interval_s <= 0:
            raise ValueError(f"StackSampler: interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.thread_id = thread_id
        self.max_depth = max_depth
        self.samples = 0
        self.seconds = 0.0
        # keyed by code object (and line) while sampling: the names are made once, when asked for, not per frame
        # per sample, which would take the GIL from the thread being measured
        self._self: Counter[tuple] = Counter()
        self._stacks: Counter[tuple] = Counter()  # each sample's distinct code objects, innermost first
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._switch = sys.getswitchinterval()

    def __enter__(self) -> StackSampler:
        if self.thread_id is None:
            self.thread_id = threading.get_ident()
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch, self.interval_s))
        self._thread = threading.Thread(target=self._run, name="jetrl-stack-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        sys.setswitchinterval(self._switch)

    def _run(self) -> None:
        last = t0 = time.perf_counter()
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self.thread_id)
            now = time.perf_counter()
            dt, last = now - last, now
            if frame is None:
                continue
            self.samples += 1
            self._self[(frame.f_code, frame.f_lineno)] += dt
            stack: list = []
            seen: set = set()  # a set beside the list: membership per frame stays O(1) on deep stacks
            depth = 0
            while frame is not None and depth < self.max_depth:
                code = frame.f_code
                if code not in seen:  # recursion counts once per sample
                    seen.add(code)
                    stack.append(code)
                frame, depth = frame.f_back, depth + 1
            self._stacks[tuple(stack)] += dt
        self.seconds = last - t0

    def self_us(self) -> dict[str, float]:
        """us charged to each innermost frame (function and line)."""
        out: dict[str, float] = {}
        for (code, line), v in self._self.items():
            key = frame_key(code.co_filename, _name(code), line)
            out[key] = out.get(key, 0.0) + v * 1e6
        return out

    def cum_us(self) -> dict[str, float]:
        """us during which each function was anywhere on the stack: a sample counts once per name, so code objects
        that share one (a nested module's `forward` inside its parent's) never add up to more than the wall time."""
        out: dict[str, float] = {}
        for stack, v in self._stacks.items():
            for key in {frame_key(code.co_filename, _name(code)) for code in stack}:
                out[key] = out.get(key, 0.0) + v * 1e6
        return out


def _name(code) -> str:
    """The qualified name (`LlamaMLP.forward`, not `forward`): a model's modules all define `forward`."""
    return getattr(code, "co_qualname", code.co_name)


def per_step(long: dict[str, float], short: dict[str, float], steps: int, top: int = 30) -> list[tuple[str, float]]:
    """The `top` keys by (long - short) / steps: what the extra `steps` decode steps of the longer run spent, the
    work both runs share (prefill, start-up) cancelled; negatives (sampling noise) dropped."""
    if steps <= 0:
        raise ValueError(f"per_step: steps must be > 0, got {steps}")
    diff = {k: (long.get(k, 0.0) - short.get(k, 0.0)) / steps for k in set(long) | set(short)}
    return [(k, round(v, 1)) for k, v in sorted(diff.items(), key=lambda kv: -kv[1])[:top] if v > 0]
