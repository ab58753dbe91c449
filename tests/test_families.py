"""The model-family table (spmd_rl/models/families.py): per-layer sliding windows, and the families
`--help` names are the table's. Run with ``python3 -m pytest tests/test_families.py -q``."""

from __future__ import annotations

from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

from spmd_rl.models import sliding_window
from spmd_rl.models.families import FAMILIES, MEGATRON_FAMILIES, layer_windows, megatron_families, supported_families

SMALL = dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=3, intermediate_size=64, vocab_size=50)


def test_layer_windows_follow_the_config() -> None:
    assert layer_windows(LlamaConfig(**SMALL)) == [None] * 3
    assert layer_windows(MistralConfig(sliding_window=12, **SMALL)) == [12] * 3
    assert layer_windows(Qwen2Config(sliding_window=16, use_sliding_window=False, **SMALL)) == [None] * 3
    assert layer_windows(Qwen2Config(sliding_window=16, use_sliding_window=True, max_window_layers=1,
                                     **SMALL)) == [None, 16, 16]
    gemma = Gemma3TextConfig(sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                             **SMALL)
    assert layer_windows(gemma) == [8, None, 8]
    for config in (gemma, MistralConfig(sliding_window=12, **SMALL), LlamaConfig(**SMALL)):
        assert sliding_window(config) == max((w for w in layer_windows(config) if w), default=None)


def test_help_names_every_family() -> None:
    from spmd_rl.config.sections import ModelConfig
    import inspect

    source = inspect.getsource(ModelConfig)
    assert "Model types on the fast paths (built-in rollout decode, FSDP engine attention): " + \
        ", ".join(FAMILIES) + ";" in " ".join(source.split())
    assert supported_families().startswith("llama (Llama 2 / 3.x")


def test_help_names_the_megatron_families() -> None:
    """``--actor.engine``'s help lists the model types the megatron engine converts, which are the
    table's (the engine refuses the others by name: tests/test_megatron_model.py)."""
    from spmd_rl.config.engines import ActorConfig
    import inspect

    source = " ".join(inspect.getsource(ActorConfig).split())
    assert "megatron-core (`actor.megatron.*`; model types llama (incl. llama3 RoPE scaling), " + \
        ", ".join(list(MEGATRON_FAMILIES)[1:]) + ";" in source
    assert "gemma3_text" not in MEGATRON_FAMILIES and megatron_families().startswith("llama (Llama 2 / 3.x")
