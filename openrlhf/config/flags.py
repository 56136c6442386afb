"""Flags derived from the schema: one `FlagSpec` per dataclass field, in declaration order.

The parser (`parser`), the validator (`validation`) and the doc tables (`docs`) all walk
`flag_specs()`, so a field added to `schema` is a flag everywhere at once.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any, Iterator, Literal

from .schema import PPOConfig

__all__ = ["FlagSpec", "flag_specs", "section_help", "get_field", "default_str"]


@dataclass(frozen=True)
class FlagSpec:
    """One flag, derived from one dataclass field."""

    dest: str  # dotted path in PPOConfig, e.g. "actor.adam.lr"
    section: str  # "actor.adam"; "" for top-level fields
    type: type  # element type: str, int, float or bool
    default: Any
    help: str
    optional: bool = False  # None is a valid value
    nargs: int | str | None = None  # tuple fields: the number of values, "*" for tuple[T, ...]
    choices: tuple[Any, ...] | None = None
    aliases: tuple[str, ...] = ()
    const_aliases: tuple[tuple[str, Any], ...] = ()
    bounds: tuple[tuple[str, float], ...] = ()

    @property
    def flag(self) -> str:
        return f"--{self.dest}"

    def type_str(self) -> str:
        if self.choices is not None:
            return "{" + ",".join(str(c) for c in self.choices) + "}"
        if self.type is bool:
            return "flag"
        name = self.type.__name__
        if self.nargs == "*":
            return f"{name} ..."
        return " ".join([name] * self.nargs) if self.nargs else name


def _resolve_hint(hint: Any) -> tuple[type, bool, int | str | None, tuple | None]:
    """(element type, optional, nargs, choices) of a field's type hint."""
    optional = False
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        if len(args) != 1:
            raise TypeError(f"unsupported union type {hint}")
        hint, origin = args[0], typing.get_origin(args[0])
    if origin is Literal:
        choices = typing.get_args(hint)
        return type(choices[0]), optional, None, choices
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return args[0], optional, "*", None
        if Ellipsis in args or len(set(args)) != 1:
            raise TypeError(f"tuple fields must be fixed-length and homogeneous, got {hint}")
        return args[0], optional, len(args), None
    if hint not in (str, int, float, bool):
        raise TypeError(f"unsupported field type {hint}")
    return hint, optional, None, None


def _walk(cls: type, default: Any, prefix: str, child_aliases: dict[str, tuple[str, ...]]) -> Iterator[FlagSpec]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli") is False:
            continue
        value = getattr(default, f.name)
        dest = prefix + f.name
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _walk(hints[f.name], value, dest + ".", f.metadata.get("child_aliases", {}))
            continue
        elem, optional, nargs, choices = _resolve_hint(hints[f.name])
        yield FlagSpec(
            dest=dest,
            section=prefix[:-1],
            type=elem,
            default=value,
            help=f.metadata.get("help", ""),
            optional=optional,
            nargs=nargs,
            choices=choices,
            aliases=tuple(f.metadata.get("aliases", ())) + tuple(child_aliases.get(f.name, ())),
            const_aliases=tuple(f.metadata.get("const_aliases", {}).items()),
            bounds=tuple(f.metadata.get("bounds", {}).items()),
        )


@functools.lru_cache(maxsize=None)
def flag_specs() -> tuple[FlagSpec, ...]:
    """Every flag of PPOConfig, in declaration order (sections first, then top-level fields)."""
    return tuple(_walk(PPOConfig, PPOConfig(), "", {}))


@functools.lru_cache(maxsize=None)
def section_help() -> dict[str, str]:
    """Dotted section name -> its help text (from the `section(...)` metadata)."""
    out: dict[str, str] = {}

    def visit(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                out[prefix + f.name] = f.metadata.get("help", "")
                visit(hints[f.name], prefix + f.name + ".")

    visit(PPOConfig, "")
    return out


def get_field(cfg: Any, dest: str) -> Any:
    for part in dest.split("."):
        cfg = getattr(cfg, part)
    return cfg



def default_str(value: Any) -> str:
    if isinstance(value, tuple):
        return " ".join(str(v) for v in value)
    return str(value)

