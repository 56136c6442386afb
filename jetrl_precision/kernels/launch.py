"""Kernel launches with less host time, and one seam where a host-cost measurement can take them over.

`kernel[grid](*args, **meta)` runs Triton's `JITFunction.run` on every call: it re-reads knobs from the
environment, binds and specializes every argument, builds a string cache key, looks the compiled kernel up,
checks globals, and only then calls the compiled kernel's launcher. On the H200's host that costs 19-25 us per
launch, against 21-24 us for a whole `torch._scaled_mm`. A `TritonLauncher` does the lookup once per argument
signature: the first launch goes through `kernel[grid]` (which returns the compiled kernel), and repeats call its
launcher directly, `compiled.run(grid..., stream, function, packed_metadata, None, None, None, *args)`, the call
`JITFunction.run` itself makes in Triton 3.4-3.6.

The key of a repeat is stricter than Triton's specialization: every int/float/bool argument by value, every
tensor by dtype and 16-byte alignment, the constexprs and launch options, and the current device. A repeat with
the same key is a call Triton would have specialized identically, so it gets the same compiled kernel.
Direct launches are off (every launch is `kernel[grid]`) when Triton's version is outside the checked range, when
a launch hook is set (a profiler such as proton must see each launch), with `JETRL_TRITON_DIRECT_LAUNCH=0`, or
after the first direct launch fails (logged once). They are on by default for the Triton versions whose GPU test
(same bytes as `kernel[grid]`, the direct path taken) passed on a device, and opt-in (`=1`) for the others.

`override_launches(fn)` routes every launch of this module's launchers (and of the CUDA requantizer) to
`fn(name, grid, args, meta)` instead of the GPU: the CPU host-cost proxy (`benchmarks/host_cost.py`) uses it to
run the CUDA code path with the kernels replaced by the reference quantizer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any, Callable, Iterator

import torch

__all__ = [
    "TritonLauncher",
    "direct_launch_status",
    "override_launches",
    "launch_override",
    "DIRECT_LAUNCH_VERSIONS",
    "DEVICE_CHECKED_VERSIONS",
]

logger = logging.getLogger(__name__)

# Triton versions whose JITFunction.run ends in the launcher call reproduced here (read in their sources).
DIRECT_LAUNCH_VERSIONS = ((3, 4), (3, 5), (3, 6))
# Of those, the versions whose direct launches passed tests/gpu/test_train_plan_gpu.py on a GPU: on by default there,
# opt-in (JETRL_TRITON_DIRECT_LAUNCH=1) elsewhere.
DEVICE_CHECKED_VERSIONS = ((3, 6),)
_MAX_KEYS = 256  # per kernel; varying token counts (packed batches) would otherwise grow the table without bound

LaunchOverride = Callable[[str, tuple, tuple, dict], None]
_override: list[LaunchOverride | None] = [None]
_status: dict[str, Any] = {}
_lock = threading.Lock()


def launch_override() -> LaunchOverride | None:
    """The function launches currently go to instead of the GPU (None: they run)."""
    return _override[0]


@contextlib.contextmanager
def override_launches(fn: LaunchOverride) -> Iterator[None]:
    """Within the block, every launch calls `fn(kernel_name, grid, args, meta)` and no kernel runs.

    For host-cost measurements and CPU tests of the CUDA code path; process-wide, not thread-local.
    """
    prev = _override[0]
    _override[0] = fn
    try:
        yield
    finally:
        _override[0] = prev


def _triton_version() -> tuple[int, int] | None:
    try:
        import triton
    except Exception:  # noqa: BLE001 - no (working) triton: nothing to launch directly
        return None
    try:
        major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    except ValueError:
        return None
    return major, minor


def direct_launch_status() -> tuple[bool, str]:
    """(enabled, reason): whether repeat launches bypass `JITFunction.run` in this process."""
    if "enabled" not in _status:
        with _lock:
            if "enabled" not in _status:
                ver = _triton_version()
                env = os.environ.get("JETRL_TRITON_DIRECT_LAUNCH", "")
                if env == "0":
                    ok, why = False, "JETRL_TRITON_DIRECT_LAUNCH=0"
                elif os.environ.get("TRITON_INTERPRET", "0") == "1":
                    ok, why = False, "TRITON_INTERPRET=1 (kernels run in the interpreter)"
                elif ver is None:
                    ok, why = False, "triton is not importable"
                elif ver not in DIRECT_LAUNCH_VERSIONS:
                    ok, why = False, (f"triton {ver[0]}.{ver[1]} is outside the checked versions "
                                      f"{', '.join(f'{a}.{b}' for a, b in DIRECT_LAUNCH_VERSIONS)}; launching through kernel[grid]")
                elif ver not in DEVICE_CHECKED_VERSIONS and env != "1":
                    ok, why = False, (f"triton {ver[0]}.{ver[1]}: its GPU test has not run on a device; "
                                      "JETRL_TRITON_DIRECT_LAUNCH=1 turns direct launches on")
                else:
                    ok, why = True, f"triton {ver[0]}.{ver[1]}"
                _status["why"] = why
                _status["enabled"] = ok
    return _status["enabled"], _status["why"]


def _disable(why: str) -> None:
    with _lock:
        if _status.get("enabled"):
            logger.warning("jetrl_precision: direct Triton launches disabled (%s); launching through kernel[grid]", why)
        _status["enabled"], _status["why"] = False, why


_runtime_knobs: list[Any] = []


def _hook_active(hook: Any) -> bool:
    """Whether a Triton launch hook would run. None runs nothing, and neither does an empty `HookChain`, which is
    what newer Triton (3.6) keeps in its knobs instead of None."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if isinstance(calls, list) else True


def _hooks_set() -> bool:
    """Whether a launch hook (a profiler such as proton) is installed: such launches go through kernel[grid]."""
    if not _runtime_knobs:
        from triton import knobs

        _runtime_knobs.append(knobs.runtime)
    rt = _runtime_knobs[0]
    return _hook_active(rt.launch_enter_hook) or _hook_active(rt.launch_exit_hook)


def _current_device() -> int:
    return torch.cuda.current_device()


def _raw_stream(device: int) -> int:
    """The current stream of `device` as the integer handle Triton's launchers take (what Triton itself passes)."""
    return torch._C._cuda_getCurrentRawStream(device)


class TritonLauncher:
    """`launcher(grid, *args, **meta)` == `kernel[grid](*args, **meta)`, with repeats launched directly.

    `meta` holds the kernel's constexpr parameters and Triton launch options (num_warps, num_stages).
    """

    __slots__ = ("kernel", "name", "_table", "_names")

    def __init__(self, kernel: Any, name: str | None = None) -> None:
        self.kernel = kernel
        self.name = name or getattr(getattr(kernel, "fn", None), "__name__", None) or getattr(kernel, "__name__", "kernel")
        self._table: dict[tuple, tuple] = {}
        self._names: tuple[str, ...] | None = None

    def __call__(self, grid: tuple, *args: Any, **meta: Any) -> None:
        override = _override[0]
        if override is not None:
            override(self.name, grid, args, meta)
            return
        if not (_status["enabled"] if "enabled" in _status else direct_launch_status()[0]) or _hooks_set():
            self.kernel[grid](*args, **meta)
            return
        dev = _current_device()
        key = (dev, *[(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a for a in args], *meta.items())
        entry = self._table.get(key)
        if entry is not None:
            run, function, packed, tail = entry
            g1 = grid[1] if len(grid) > 1 else 1
            g2 = grid[2] if len(grid) > 2 else 1
            try:
                run(grid[0], g1, g2, _raw_stream(dev), function, packed, None, None, None, *args, *tail)
            except Exception as e:  # noqa: BLE001 - the launcher refused the call before launching: go the normal way
                _disable(f"{self.name}: {type(e).__name__}: {e}")
                self.kernel[grid](*args, **meta)
            return
        entry = self._entry(self.kernel[grid](*args, **meta), len(args), meta)
        if entry is not None:
            if len(self._table) >= _MAX_KEYS:
                self._table.clear()
            self._table[key] = entry

    def _entry(self, compiled: Any, n_args: int, meta: dict) -> tuple | None:
        """(run, function, packed_metadata, constexpr tail) of a compiled kernel, or None if it lacks them."""
        if self._names is None:
            names = getattr(self.kernel, "arg_names", None)
            if names is None:
                _disable(f"{self.name}: the JIT function has no arg_names")
                return None
            self._names = tuple(names)
        missing = [n for n in self._names[n_args:] if n not in meta]
        if missing:
            _disable(f"{self.name}: parameters {missing} were not passed by keyword")
            return None
        try:
            run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
        except AttributeError as e:
            _disable(f"{self.name}: the compiled kernel lacks {e}")
            return None
        if function is None:
            return None  # not loaded yet; the next launch through kernel[grid] loads it
        return run, function, packed, tuple(meta[n] for n in self._names[n_args:])
