"""The one configuration of a run: nested dataclasses, YAML presets, tyro flags.

Every field has a docstring (tyro shows it in ``--help``) and ``Literal`` marks closed choices.
Precedence is CLI flag > ``--config`` YAML > dataclass default::

    cfg = load_config(["--config", "configs/gsm8k.yaml", "--rollout.n", "16"])

``__post_init__`` only checks values that need no knowledge of the world; rules that depend on the
number of processes live in :mod:`spmd_rl.plan` and run before any process group exists.
Components receive the narrowest section they need (``cfg.rollout``, ``cfg.actor.fsdp``), never
the root. The sections live in :mod:`.sections` and :mod:`.engines` (actor, ref), reading YAML and
flags in :mod:`.loading`.
"""

from .checks import validate
from .engines import ActorConfig, CriticConfig, CriticModelConfig, FsdpConfig, LoraConfig, MegatronConfig, RefConfig
from .episodes import AgentConfig, EnvConfig
from .loading import from_yaml, load_config, split_config_flag, to_dict, to_yaml
from .sections import (
    AlgoConfig, CheckpointConfig, Config, DataConfig, LoggingConfig, ModelConfig, PlanConfig, PoolsConfig, RewardConfig,
    RewardModelConfig, RolloutConfig, TeacherConfig, TeacherModelConfig, TrainerConfig,
)

__all__ = [
    "ActorConfig", "AgentConfig", "AlgoConfig", "CheckpointConfig", "Config", "CriticConfig", "CriticModelConfig", "DataConfig", "EnvConfig",
    "FsdpConfig", "LoggingConfig", "LoraConfig", "MegatronConfig", "ModelConfig", "PlanConfig", "PoolsConfig", "RefConfig", "RewardConfig",
    "RewardModelConfig", "RolloutConfig", "TeacherConfig", "TeacherModelConfig", "TrainerConfig", "from_yaml", "load_config", "split_config_flag",
    "to_dict", "to_yaml", "validate",
]
