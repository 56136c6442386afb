"""The field helpers the config sections are written with, and dict (de)serialization.

Each config field carries metadata the flag parser, the validator and the docs read: help text,
pre-0.11 flat aliases (`--pretrain`), short flags that set a constant (`--fp8_unified`) and
numeric bounds. `to_plain` / `from_nested` turn a config into nested plain dicts and back.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import operator
from dataclasses import field
from typing import Any, Sequence

__all__ = ["ConfigError", "BOUNDS", "opt", "section", "to_plain", "from_nested"]


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the flag(s) and the fix."""


# Numeric bounds a field may declare (opt(..., ge=1)): name -> (symbol, check).
BOUNDS = {"ge": (">=", operator.ge), "gt": (">", operator.gt), "le": ("<=", operator.le)}


def opt(
    default: Any,
    help: str,
    *,
    aliases: Sequence[str] = (),
    const_aliases: dict[str, Any] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
) -> Any:
    """A flag field. `const_aliases` maps a short flag to the value it stands for (--fp8_unified)."""
    metadata = {
        "help": help,
        "aliases": tuple(aliases),
        "const_aliases": dict(const_aliases or {}),
        "bounds": {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le)) if v is not None},
    }
    return field(default=default, metadata=metadata)


def section(cls: type, help: str, *, aliases: dict[str, Sequence[str]] | None = None, **defaults: Any) -> Any:
    """A nested section. `aliases` adds flat aliases to its fields (per use: actor vs critic adam)."""
    metadata = {"help": help, "child_aliases": {k: tuple(v) for k, v in (aliases or {}).items()}}
    return field(default_factory=functools.partial(cls, **defaults), metadata=metadata)



def to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [to_plain(v) for v in value]
    return value


def from_nested(cls: type, default: Any, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {data!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    changes = {}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {where}{close[0]}?" if close else ""
            raise ConfigError(f"unknown config key {where}{key}{hint}")
        current = getattr(default, key)
        if dataclasses.is_dataclass(current):
            changes[key] = from_nested(type(current), current, value, f"{where}{key}.")
        else:
            changes[key] = tuple(value) if isinstance(value, list) else value
    return dataclasses.replace(default, **changes)

