"""Typed configuration: sections, TOML loading, overrides and validation."""

from relaytrain.config.loader import (
    config_from_dict,
    config_hash,
    config_to_dict,
    config_to_toml,
    load_config,
)
from relaytrain.config.overrides import check_overrides, parse_override, split_config_args
from relaytrain.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    MetricsConfig,
    ModelConfig,
    NotifyConfig,
    OptimConfig,
    ParallelConfig,
    ResilienceConfig,
    RunConfig,
    SlurmConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "MetricsConfig",
    "NotifyConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "ResilienceConfig",
    "RunConfig",
    "SlurmConfig",
    "TrainConfig",
    "check_overrides",
    "config_from_dict",
    "config_hash",
    "config_to_dict",
    "config_to_toml",
    "load_config",
    "parse_override",
    "split_config_args",
]
