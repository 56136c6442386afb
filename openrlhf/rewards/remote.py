"""Reward functions given on the command line (--reward.remote_url / --remote_rm_url).

A spec is either
- a path to a ``.py`` file that defines ``reward_func(queries, prompts, labels, **kw)``
  returning a list/tensor of floats, or a dict with ``"rewards"`` (other keys such as
  ``"scores"``/``"extra_logs"`` are ignored here), or
- an ``http://``/``https://`` URL that accepts a POST of JSON
  ``{"query": [...], "prompts": [...], "labels": [...]}`` and answers ``{"rewards": [...]}``
  (or a plain list).
The returned callable is ``fn(queries, prompts, labels) -> list[float]`` where queries are
prompt + response.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["RewardFn", "RewardFunctionError", "RewardServerError", "load_reward_fn", "normalize_rewards"]

RewardFn = Callable[[Sequence[str], Sequence[str], Sequence["str | None"]], list]


class RewardFunctionError(ValueError):
    """A reward function file that cannot be loaded or called, or that returned unusable rewards."""


class RewardServerError(RuntimeError):
    """A reward server that cannot be reached or rejected the request."""


def _where_in(path: Path, exc: BaseException) -> str:
    """'file:line' of the deepest frame of `exc` inside `path` (the user's own code), else of the last frame."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if Path(f.filename).resolve() == path]
    f = (mine or frames or [None])[-1]
    return f"{f.filename}:{f.lineno}" if f is not None else str(path)


def normalize_rewards(out: Any, n: int, source: str) -> list[float]:
    """Accept a list/tuple/tensor/ndarray of numbers or a dict with "rewards"; check the length."""
    if isinstance(out, dict):
        if "rewards" not in out:
            raise RewardFunctionError(f"reward function {source} returned a dict without 'rewards' (keys: {sorted(out)})")
        out = out["rewards"]
    if hasattr(out, "tolist"):  # torch tensor / numpy array
        out = out.tolist()
    if not isinstance(out, (list, tuple)):
        raise RewardFunctionError(f"reward function {source} returned {type(out).__name__}; expected a list of floats or {{'rewards': [...]}}")
    try:
        rewards = [float(x) for x in out]
    except (TypeError, ValueError) as e:
        raise RewardFunctionError(f"reward function {source} returned non-numeric rewards: {e}") from None
    if len(rewards) != n:
        raise RewardFunctionError(f"reward function {source} returned {len(rewards)} rewards for {n} queries")
    if not all(math.isfinite(r) for r in rewards):
        raise RewardFunctionError(f"reward function {source} returned non-finite rewards: {rewards}")
    return rewards


def _load_py(path_str: str) -> RewardFn:
    path = Path(path_str).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"reward function file {path_str!r} does not exist (--reward.remote_url)")
    # A unique module name per file, so two reward files never shadow each other.
    mod_name = "openrlhf_reward_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import reward function file {str(path)!r}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's file: name where it failed, not our import machinery
        raise RewardFunctionError(
            f"reward function file {path} failed to import at {_where_in(path, e)}: {type(e).__name__}: {e} (--reward.remote_url)"
        ) from e
    func = getattr(module, "reward_func", None)
    if not callable(func):
        raise RewardFunctionError(
            f"{str(path)!r} must define reward_func(queries, prompts, labels, **kwargs); "
            f"found {sorted(n for n in vars(module) if not n.startswith('_'))}"
        )

    def reward_fn(queries: Sequence[str], prompts: Sequence[str], labels: Sequence[str | None], **kw: Any) -> list[float]:
        try:
            out = func(list(queries), list(prompts), list(labels), **kw)
        except Exception as e:
            raise RewardFunctionError(
                f"reward_func in {path} raised {type(e).__name__}: {e} at {_where_in(path, e)}; it is called as "
                f"reward_func(queries, prompts, labels) with {len(queries)} queries: fix it and rerun"
            ) from e
        return normalize_rewards(out, len(queries), str(path))

    reward_fn.__name__ = f"reward_func[{path.name}]"
    return reward_fn


def _load_http(url: str, timeout: float, retries: int) -> RewardFn:
    def reward_fn(queries: Sequence[str], prompts: Sequence[str], labels: Sequence[str | None]) -> list[float]:
        body = json.dumps({"query": list(queries), "prompts": list(prompts), "labels": list(labels)}).encode()
        last_err: Exception | None = None
        for attempt in range(retries + 1):
            req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=timeout) as resp:
                    payload = json.loads(resp.read().decode("utf-8"))
                return normalize_rewards(payload, len(queries), url)
            except urllib.error.HTTPError as e:
                if e.code < 500:  # the server rejected the request: retrying will not help
                    detail = e.read()[:300].decode("utf-8", "replace")
                    raise RewardServerError(f"reward server {url} answered HTTP {e.code}: {detail} (--reward.remote_url)") from None
                last_err = e
            except (urllib.error.URLError, TimeoutError, OSError, json.JSONDecodeError) as e:
                last_err = e
            if attempt < retries:
                time.sleep(min(0.5 * 2**attempt, 5.0))
        raise RewardServerError(
            f"reward server {url} failed after {retries + 1} attempt(s) (timeout {timeout}s each): {last_err!r}. "
            "Check that it is running and reachable (--reward.remote_url)"
        )

    reward_fn.__name__ = f"remote_reward[{url}]"
    return reward_fn


def load_reward_fn(spec: str, *, timeout: float = 60.0, retries: int = 2) -> RewardFn:
    """Callable ``fn(queries, prompts, labels) -> list[float]`` for a ``.py`` path or an HTTP(S) URL."""
    s = spec.strip()
    if s.startswith(("http://", "https://")):
        return _load_http(s, timeout, retries)
    if s.endswith(".py"):
        return _load_py(s)
    raise RewardFunctionError(
        f"cannot use reward spec {spec!r}: pass a .py file defining reward_func(queries, prompts, labels) "
        "or an http(s):// URL (--reward.remote_url)"
    )
