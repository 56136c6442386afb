"""The command line: an argparse parser generated from the schema, and `parse_config`.

`parse_config` = argparse -> nested dataclasses -> `validate`. Problems a user can make on the
command line (unknown flag, an alias and its dotted name with different values, a rule broken
by `validate`) exit with status 2 and one message that names the flag and the fix.

    cfg = parse_config(["--pretrain", "m", "--prompt_data", "d.jsonl", "--fp8_unified"])
    cfg.actor.adam.lr, cfg.precision.recipe, cfg.needs_critic
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import Any, Sequence

from .fields import ConfigError
from .flags import FlagSpec, default_str, flag_specs, section_help
from .schema import PPOConfig
from .validation import validate

__all__ = ["build_parser", "parse_config", "parse_unvalidated"]


_ALIAS_SEP = "|"  # argparse dest of an alias: "<dotted dest>|<alias flag>", so conflicts can be seen


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=44, width=120)



def _flag_help(spec: FlagSpec) -> str:
    text = spec.help
    if spec.type is not bool:
        text += f" [default: {default_str(spec.default)}]"
    if spec.aliases:
        text += f" (alias: {', '.join(spec.aliases)})"
    return text.replace("%", "%%")


_DESCRIPTION = """\
PPO/GRPO training with one FP8 precision flow shared by rollout and training (Jet-RL).

Flags are OpenRLHF v0.11's dotted names (--<section>.<field>); the pre-0.11 flat names
(--pretrain, --prompt_data, --vllm_num_engines, ...) are accepted as aliases. See docs/cli.md."""

_EPILOG = """\
examples:
  GRPO, unified FP8:  --pretrain M --prompt_data D.jsonl --algo.advantage.estimator group_norm \\
                      --rollout.n_samples_per_prompt 8 --algo.kl.use_loss --algo.kl.estimator k3 --fp8_unified
  FP8 rollout only:   ... --precision.recipe fp8_rollout --algo.advantage.is_correction_enable"""


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The argparse parser, generated from the dataclasses. Absent flags are absent from the
    Namespace (default=SUPPRESS): defaults live in the dataclasses only."""
    parser = argparse.ArgumentParser(
        prog=prog or "train_ppo_ray",
        usage="%(prog)s [-h] [--<section>.<field> VALUE ...] [flat aliases such as --pretrain PATH ...]",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=_HelpFormatter,
        allow_abbrev=False,  # a prefix must never silently pick a flag
        argument_default=argparse.SUPPRESS,
    )
    helps = section_help()
    groups: dict[str, argparse._ArgumentGroup] = {}
    for spec in flag_specs():
        if spec.section not in groups:
            title = f"--{spec.section}.*" if spec.section else "launcher"
            groups[spec.section] = parser.add_argument_group(title, helps.get(spec.section, "set by launchers"))
        group = groups[spec.section]
        if spec.type is bool:
            kwargs: dict[str, Any] = {"action": "store_true"}
        else:
            kwargs = {"type": spec.type, "metavar": spec.type.__name__.upper()}
            if spec.choices is not None:
                kwargs["choices"] = spec.choices
                del kwargs["metavar"]
            if spec.nargs:
                kwargs["nargs"] = spec.nargs
        group.add_argument(spec.flag, dest=spec.dest, help=_flag_help(spec), **kwargs)
        for alias in spec.aliases:
            group.add_argument(alias, dest=f"{spec.dest}{_ALIAS_SEP}{alias}", help=argparse.SUPPRESS, **kwargs)
        for alias, const in spec.const_aliases:
            group.add_argument(
                alias,
                dest=f"{spec.dest}{_ALIAS_SEP}{alias}",
                action="store_const",
                const=const,
                help=f"short for {spec.flag} {const}",
            )
    return parser


def _suggest(flag: str) -> list[str]:
    """The closest flags to an unknown one: by spelling, with a bonus for the same leaf name
    (--actor.lr -> --actor.adam.lr; --lr -> --actor.adam.lr, --critic.adam.lr) or a prefix."""
    canonical: dict[str, str] = {}  # any option string -> the flag to suggest
    for spec in flag_specs():
        canonical[spec.flag] = spec.flag
        canonical.update({alias: spec.flag for alias in spec.aliases})
        canonical.update({alias: alias for alias, _ in spec.const_aliases})  # --fp8_unified is its own thing
    leaf = flag.lstrip("-").rsplit(".", 1)[-1]
    scores: dict[str, float] = {}
    for option, target in canonical.items():
        score = difflib.SequenceMatcher(None, flag, option).ratio()
        score += 0.2 if option.lstrip("-").rsplit(".", 1)[-1] == leaf else 0.0
        score += 0.2 if "." in flag and option.startswith(flag) else 0.0  # an abbreviated dotted flag
        scores[target] = max(score, scores.get(target, 0.0))
    best = max(scores.values())
    if best < 0.6:
        return []
    ranked = sorted((t for t, sc in scores.items() if sc >= best - 0.05), key=lambda t: -scores[t])
    return ranked[:3]


def _unknown_message(extras: list[str]) -> str:
    flags = [e.split("=", 1)[0] for e in extras if re.match(r"^--?[A-Za-z]", e)]
    if not flags:
        return f"unrecognized argument(s): {' '.join(extras)}; values must follow a flag"
    lines = []
    for flag in flags:
        close = _suggest(flag)
        hint = f"; did you mean {' or '.join(close)}?" if close else "; see --help for the flag list"
        lines.append(f"unrecognized argument {flag}{hint}")
    return "\n".join(lines)


def _normalize(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _merge_given(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> dict[str, Any]:
    """{dotted dest: value} of the flags given; an alias and its dotted name must agree."""
    given: dict[str, list[tuple[str, Any]]] = {}
    for key, value in vars(ns).items():
        dest, _, alias = key.partition(_ALIAS_SEP)
        given.setdefault(dest, []).append((alias or f"--{dest}", _normalize(value)))
    consts = {alias for spec in flag_specs() for alias, _ in spec.const_aliases}
    values = {}
    for dest, pairs in given.items():
        if len({repr(v) for _, v in pairs}) > 1:
            shown = [f"{f} (= {default_str(v)})" if f in consts else f"{f} {default_str(v)}" for f, v in pairs]
            parser.error(
                f"conflicting values for --{dest}: {' vs '.join(shown)}; "
                f"these flags set the same option, pass only one of them"
            )
        values[dest] = pairs[-1][1]
    return values


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> PPOConfig:
    ns, extras = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if extras:
        parser.error(_unknown_message(extras))
    return _from_flat(_merge_given(parser, ns))


def parse_unvalidated(argv: Sequence[str] | None = None) -> PPOConfig:
    """Flags -> PPOConfig without `validate` (tools and tests that only need the mapping)."""
    return _parse(build_parser(), argv)


def parse_config(argv: Sequence[str] | None = None, *, exit_on_error: bool = True) -> PPOConfig:
    """Parse `argv` (default sys.argv[1:]) into a validated PPOConfig.

    Command-line mistakes exit with status 2 and an argparse-style message. A rule broken by
    `validate` does the same, unless `exit_on_error=False`, which raises the ConfigError instead.
    """
    parser = build_parser()
    cfg = _parse(parser, argv)
    try:
        return validate(cfg)
    except ConfigError as e:
        if not exit_on_error:
            raise
        parser.error(str(e))
        raise  # unreachable: parser.error exits



def _from_flat(values: dict[str, Any]) -> PPOConfig:
    """PPOConfig from {dotted dest: value}; absent dests keep their defaults."""
    nested: dict[str, Any] = {}
    for dest, value in values.items():
        *parents, leaf = dest.split(".")
        node = nested
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return PPOConfig.from_dict(nested)
