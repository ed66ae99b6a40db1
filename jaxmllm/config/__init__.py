"""Typed experiment configs: frozen dataclasses loaded from YAML with dotted overrides.

Every field carries a docstring-style comment. Loading rejects unknown keys (naming the closest
valid one), wrong types and failed checks, always naming the key and the file, so a bad config
stops the run at start-up with a message that says what to change.

Rooms, bottom to top: `checks` (ConfigError and the checks), `remat` (the rematerialisation
policies by name), `blocks` (what a tower's blocks are made of), `decoder` (the LLM and its
mixture of experts), `model` (encoders, decoder, how they compute), `sections` (mesh, pipeline,
batch, data, optimizer, loop, launch), `yamlfile` (YAML as configs read it), `load` (the whole
`Config`, YAML and overrides).
"""

from jaxmllm.config.checks import ConfigError, UserError
from jaxmllm.config.decoder import LLMConfig, MoEConfig
from jaxmllm.config.load import (
    Config,
    closest_name,
    config_origin,
    from_dict,
    keep_origin,
    load_config,
    to_dict,
)
from jaxmllm.config.model import (
    ATTENTIONS,
    AudioConfig,
    InitFrom,
    ModelConfig,
    VisionConfig,
)
from jaxmllm.config.printable import guard_logs, printable
from jaxmllm.config.remat import REMAT_POLICIES, RematPolicy
from jaxmllm.config.sections import (
    AUTO_LADDERS,
    AUTO_SIZES,
    DATA_SOURCES,
    BatchConfig,
    DataConfig,
    DistributedConfig,
    EvalConfig,
    MeshConfig,
    OptimConfig,
    PipelineConfig,
    PreferenceConfig,
    SourceConfig,
    SyntheticConfig,
    TrainConfig,
)

__all__ = [
    "ATTENTIONS",
    "AUTO_LADDERS",
    "AUTO_SIZES",
    "DATA_SOURCES",
    "REMAT_POLICIES",
    "AudioConfig",
    "BatchConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "EvalConfig",
    "InitFrom",
    "LLMConfig",
    "MeshConfig",
    "ModelConfig",
    "MoEConfig",
    "OptimConfig",
    "PipelineConfig",
    "PreferenceConfig",
    "RematPolicy",
    "SyntheticConfig",
    "TrainConfig",
    "UserError",
    "VisionConfig",
    "SourceConfig",
    "closest_name",
    "config_origin",
    "from_dict",
    "guard_logs",
    "keep_origin",
    "load_config",
    "printable",
    "to_dict",
]
