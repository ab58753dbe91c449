"""The megatron-core engine (``actor.engine: megatron``): groups, model, weight conversion, engine."""

from spmd_rl.engine.megatron.engine import MegatronEngine

__all__ = ["MegatronEngine"]
