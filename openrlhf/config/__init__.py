"""Typed configuration of a PPO/GRPO run: frozen dataclasses, and a parser generated from them.

    fields      ConfigError and the field helpers (`opt`, `section`) the sections are written with
    schema      the sections (`ActorConfig`, `VLLMConfig`, ...) composed into `PPOConfig`
    flags       one `FlagSpec` per field: what the parser, the validator and the docs walk
    parser      argparse generated from the flags; `parse_config` = parse + `validate`
    validation  type/bound checks and the rules across fields
    parity      how each OpenRLHF v0.11 flag is treated here (supported / differs / refused, and why)
    docs        docs/cli.md's flag and parity tables (`python -m openrlhf.config.docs docs/cli.md`)
"""

from .fields import ConfigError
from .flags import FlagSpec, flag_specs
from .parity import OPENRLHF_V0_11, Parity
from .parser import build_parser, parse_config, parse_unvalidated
from .schema import (
    GROUP_ESTIMATORS,
    ActorConfig,
    AdamConfig,
    AdvantageConfig,
    AlgoConfig,
    CkptConfig,
    CriticConfig,
    DataConfig,
    DeepSpeedConfig,
    EvalConfig,
    KLConfig,
    LoraConfig,
    LoggerConfig,
    MuonConfig,
    PPOConfig,
    PrecisionConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
    VLLMConfig,
    WandbConfig,
)
from .validation import validate

__all__ = [
    "ConfigError",
    "FlagSpec",
    "AdamConfig",
    "ActorConfig",
    "RefConfig",
    "CriticConfig",
    "RewardConfig",
    "DataConfig",
    "RolloutConfig",
    "TrainConfig",
    "AdvantageConfig",
    "KLConfig",
    "AlgoConfig",
    "DeepSpeedConfig",
    "VLLMConfig",
    "CkptConfig",
    "WandbConfig",
    "LoggerConfig",
    "PrecisionConfig",
    "MuonConfig",
    "LoraConfig",
    "EvalConfig",
    "PPOConfig",
    "GROUP_ESTIMATORS",
    "build_parser",
    "parse_config",
    "parse_unvalidated",
    "validate",
    "flag_specs",
    "Parity",
    "OPENRLHF_V0_11",
]
