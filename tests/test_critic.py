"""PPO with a critic (``algo.adv_estimator=gae``, spmd_rl/critic.py): token rewards, the value model's
positions, parity of the critic's stages between FSDP on 2 ranks and one process, an end-to-end run
(one process) that learns (reward and explained variance rise) and resumes exactly
from its checkpoint, and the plan() rules.

Parity: one spawned 3-process world holds a 1-rank pool (rank 0) and a 2-rank pool (ranks 1-2);
each runs the critic's three stages (values, GAE advantages with the KL in the reward, 2 epochs x 2
mini-batches of the clipped value loss) on the same fixed batch, the 2-rank pool each rank on its
contiguous half. The 1-rank pool gets the rows in the order that gives it the same mini-batches
(mini-batch k is the k-th quarter of every rank's half). Compared in fp32: the metrics, the per-row
values, returns and advantages, and the critic's weights after the updates, within 1e-5.

Run: ``python -m pytest tests/test_critic.py -q -s`` (``-s`` prints the measured differences).
"""

from __future__ import annotations

import json
import re
import shutil
from typing import Any

import pytest
import torch
import torch.distributed as dist

from spmd_rl.checkpoint_files import load_without_process_group
from spmd_rl.config import AlgoConfig, CriticConfig, FsdpConfig, load_config
from spmd_rl.critic import Critic, last_token_rewards, token_rewards
from spmd_rl.data.batch import RolloutBatch
from spmd_rl.distributed.dims import FsdpLayout
from spmd_rl.plan import plan
from spmd_rl.distributed.testing import run_distributed
from spmd_rl.engine import critic_optimizer
from spmd_rl.engine.value import load_value_model
from spmd_rl.export import load_model_state
from spmd_rl.metrics import MetricAccumulator
from spmd_rl.models import load_reward_model, resolve_model_path
from support.numerics import max_rel, rel
from test_checkpoint import launch, metrics

ROWS, PROMPTS, RESPONSE_LEN, PAD, TOL = 16, 8, 10, 0, 1e-5
SEED = 3
ALGO = dict(adv_estimator="gae", gamma=0.99, lam=0.95, kl_in_reward=True, kl_coef=0.05, kl_kind="k1",
            use_kl_loss=False, loss_agg_mode="token-mean")
CRITIC = dict(lr=3e-3, cliprange_value=0.02, micro_batch_size=3, ppo_epochs=2, grad_clip=0.5, weight_decay=0.01)
MINI_BATCHES = 2


# --------------------------------------------------------------------------- token rewards, value positions


def test_score_goes_on_the_last_response_token_and_the_kl_on_every_token() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    scores = torch.tensor([0.5, -1.0, 7.0, 2.0])
    expected = torch.zeros(4, 4)
    expected[0, 2], expected[1, 0], expected[3, 3] = 0.5, -1.0, 2.0  # a row without tokens gets nothing
    assert torch.equal(last_token_rewards(scores, mask), expected)
    old, ref = torch.randn(4, 4), torch.randn(4, 4)
    batch = RolloutBatch(prompts=[[1]] * 4, tensors={"response_mask": mask, "scores": scores, "old_logprobs": old,
                                                      "ref_logprobs": ref})
    acc = MetricAccumulator()
    got = token_rewards(batch, algo=AlgoConfig(kl_in_reward=True, kl_coef=0.1, kl_kind="k1"), acc=acc)
    torch.testing.assert_close(got, expected - 0.1 * (old - ref) * mask)
    kl = ((old - ref) * mask).sum() / mask.sum()
    assert acc.reduce()["actor/reward_kl_penalty"] == pytest.approx(kl.item(), rel=1e-6)
    assert torch.equal(token_rewards(batch, algo=AlgoConfig(), acc=MetricAccumulator()), expected)


def folder() -> str:
    return resolve_model_path("tiny-random", cache_dir=None)  # $SPMD_RL_CACHE (conftest)


def test_value_model_keeps_a_saved_head_and_seeds_a_new_one() -> None:
    """A one-output reward model keeps its trained `score` (a zero bias added); a causal LM gets a new
    head from the seed alone, and no dropout before it."""
    rm_folder = resolve_model_path("tiny-random-rm", cache_dir=None)
    value = load_value_model(rm_folder, dtype=torch.float32, seed=0)
    assert torch.equal(value.score.weight, load_reward_model(rm_folder, dtype=torch.float32).score.weight)
    assert torch.equal(value.score.bias, torch.zeros(1))
    heads = [load_value_model(folder(), dtype=torch.float32, seed=s).score.weight for s in (1, 1, 2)]
    assert torch.equal(heads[0], heads[1]) and not torch.equal(heads[0], heads[2])
    assert isinstance(value.dropout, torch.nn.Identity)


def make_batch() -> RolloutBatch:
    """Ragged prompts and responses with scores and old / reference log-probs (for the KL reward)."""
    g = torch.Generator().manual_seed(99)
    prompt_lengths = torch.randint(3, 12, (PROMPTS,), generator=g).tolist()
    prompts = [torch.randint(3, 104, (n,), generator=g).tolist() for n in prompt_lengths]
    lengths = torch.randint(1, RESPONSE_LEN + 1, (ROWS,), generator=g)
    lengths[5] = RESPONSE_LEN
    mask = (torch.arange(RESPONSE_LEN)[None, :] < lengths[:, None]).float()
    ids = torch.where(mask.bool(), torch.randint(3, 104, (ROWS, RESPONSE_LEN), generator=g), PAD)
    old = -torch.rand(ROWS, RESPONSE_LEN, generator=g) * 3 * mask
    return RolloutBatch(prompts=[prompts[i // 2] for i in range(ROWS)], tensors={
        "response_ids": ids, "response_mask": mask, "group_index": torch.arange(ROWS) // 2,
        "scores": torch.rand(ROWS, generator=g) * 2, "old_logprobs": old,
        "ref_logprobs": (old + 0.3 * torch.randn(ROWS, RESPONSE_LEN, generator=g)) * mask})


def reference_values(batch: RolloutBatch) -> torch.Tensor:
    """Values from a plain forward of the token classifier: token t's value is read at position p + t - 1."""
    model = load_value_model(folder(), dtype=torch.float32, seed=SEED)
    inputs = batch.model_inputs(PAD)
    with torch.no_grad():
        out = model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                    position_ids=inputs.position_ids).logits[..., 0]
    p, t = inputs.prompt_width, inputs.response_len
    return out[:, p - 1:p + t - 1] * batch["response_mask"]


# --------------------------------------------------------------------------- parity: 2 ranks vs one process


def single_process_order() -> list[int]:
    """Rows for the 1-rank pool so that its mini-batch k holds the rows of the 2-rank pool's mini-batch k."""
    half, part = ROWS // 2, ROWS // 2 // MINI_BATCHES
    return [r * half + k * part + i for k in range(MINI_BATCHES) for r in range(2) for i in range(part)]


def critic_stages(batch: RolloutBatch, *, mesh: Any, group: Any) -> dict[str, Any]:
    """The trainer's critic stages on this rank's contiguous share of ``batch``; collective over ``group``."""
    from spmd_rl.config import ActorConfig
    from spmd_rl.engine.fsdp import FSDPEngine

    critic, algo = CriticConfig(**CRITIC), AlgoConfig(**ALGO)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    engine = FSDPEngine(model_folder=folder(), mesh=mesh, device=torch.device("cpu"), fsdp=FsdpConfig(),
                        actor=critic_optimizer(ActorConfig(), critic), total_updates=4, trainable=True,
                        pad_token_id=PAD, group=group, value_model=True, seed=SEED)
    stages = Critic(engine, critic=critic, algo=algo, epochs=critic.ppo_epochs, mini_batches=MINI_BATCHES,
                    sum_weight=1.0, group=group)
    share = len(batch) // size
    mine = batch.select(range(rank * share, (rank + 1) * share))
    acc = MetricAccumulator()
    stages.values(mine)
    mine["advantages"] = stages.advantages(mine, token_rewards(mine, algo=algo, acc=acc), acc)
    stages.update(mine, acc)
    rows = {key: mine[key] for key in ("values", "returns", "advantages")}
    every: list[Any] = [None] * size
    dist.all_gather_object(every, rows, group=group)
    return dict(metrics=acc.reduce(group), weights={n: t.numpy().copy() for n, t in engine.named_full_tensors()},
                **{key: torch.cat([part[key] for part in every]).numpy() for key in rows})


def _parity_body(rank: int, world_size: int, batch: RolloutBatch) -> dict[str, Any]:
    groups = [dist.new_group([0]), dist.new_group([1, 2])]  # collective over the world: every rank makes both
    meshes = [FsdpLayout(1).build("cpu", start=0), FsdpLayout(2).build("cpu", start=1)]
    pool = 0 if rank == 0 else 1
    if pool == 0:
        batch = batch.select(single_process_order())
    return critic_stages(batch, mesh=meshes[pool], group=groups[pool])


@pytest.fixture(scope="module")
def parity() -> tuple[dict[str, Any], dict[str, Any], RolloutBatch]:
    batch = make_batch()
    one, two, _ = run_distributed(_parity_body, 3, batch)
    order = single_process_order()
    for key in ("values", "returns", "advantages"):  # back to the batch's row order
        rows = torch.empty_like(torch.as_tensor(one[key]))
        rows[order] = torch.as_tensor(one[key])
        one[key] = rows
    return one, two, batch


def test_values_are_read_where_the_token_is_predicted(parity) -> None:
    one, _, batch = parity
    assert rel(one["values"], reference_values(batch)) < TOL


def test_critic_on_two_ranks_equals_one_process(parity) -> None:
    one, two, _ = parity
    m1, m2 = one["metrics"], two["metrics"]
    assert sorted(m1) == sorted(m2)
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpreds/mean", "critic/returns/mean",
                "critic/values/mean", "critic/vf_explained_var", "critic/grad_norm", "critic/lr",
                "actor/reward_kl_penalty"):
        assert key in m1, key
    diffs = {k: abs(m2[k] - m1[k]) / max(abs(m1[k]), 1e-3) for k in m1}
    diffs.update({key: rel(two[key], one[key]) for key in ("values", "returns", "advantages")})
    weights, name = max_rel(two["weights"], one["weights"])
    print(f"\n2 ranks vs 1: weights {weights:.2e} ({name}); " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    assert weights < TOL, (weights, name)
    # explained variance is 1 - var(returns - values) / var(returns): the cancellation scales float32 rounding
    tols = {"critic/vf_explained_var": 10 * TOL}
    assert not {k: v for k, v in diffs.items() if v > tols.get(k, TOL)}, diffs
    assert m1["critic/vf_clipfrac"] > 0.05, "value clipping should act in the parity run"
    assert m1["critic/grad_norm"] > CRITIC["grad_clip"], "gradient clipping should act in the parity run"
    assert not any(n.startswith("lm_head") for n in one["weights"]) and "score.weight" in one["weights"]


# --------------------------------------------------------------------------- end to end

PPO = ["--algo.adv-estimator", "gae", "--algo.no-use-kl-loss", "--critic.lr", "1e-2", "--critic.ppo-epochs", "4",
       "--critic.micro-batch-size", "64", "--actor.micro-batch-size", "64", "--trainer.total-steps", "16",
       "--checkpoint.every", "12", "--checkpoint.keep", "2"]


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
    """16 PPO steps in one process (the parity test covers two ranks), checkpoints at steps 12 and 16."""
    out = tmp_path_factory.mktemp("ppo") / "run"
    launch(out, *PPO, nproc=1, timeout=600)
    return out


def test_ppo_with_a_critic_learns(ppo_run) -> None:
    steps = metrics(ppo_run)
    assert [m["step"] for m in steps] == list(range(1, 17))
    score = [m["critic/score/mean"] for m in steps]
    explained = [m["critic/vf_explained_var"] for m in steps]
    first, last = sum(score[:5]) / 5, sum(score[-5:]) / 5
    assert last > first + 0.15, f"reward did not rise: first 5 steps {first:.3f}, last 5 steps {last:.3f}"
    # step 1's values are the new head's guesses, far off the mean: compare from step 2
    early, late = sum(explained[1:6]) / 5, sum(explained[-5:]) / 5
    assert late > early + 0.05 and late > 0.05, f"explained variance did not rise: {explained}"
    last_line = json.loads((ppo_run / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpreds/mean", "critic/returns/mean",
                "critic/grad_norm", "timing_s/values", "timing_s/critic_update"):
        assert key in last_line, key


def test_resume_with_a_critic_is_exact(ppo_run, tmp_path) -> None:
    """Steps 13-16 again from the step-12 checkpoint: the same metrics, actor and critic, bit for bit; the
    export still writes the actor alone."""
    out = tmp_path / "resumed"
    launch(out, *PPO, "--checkpoint.resume", str(ppo_run / "checkpoints" / "step_12"), nproc=1, timeout=600)
    assert metrics(out) == metrics(ppo_run)[12:]
    critic = [load_without_process_group(run / "checkpoints" / "step_16", ["critic"])["critic"]
              for run in (ppo_run, out)]
    assert sorted(critic[0]) == ["model", "optimizer", "scheduler"]
    assert same_state(critic[0], critic[1])
    actor = [load_model_state(run) for run in (ppo_run, out)]
    assert sorted(actor[0]) == sorted(actor[1]) and all(torch.equal(actor[0][k], actor[1][k]) for k in actor[0])
    assert "lm_head.weight" in actor[0] and not any(k.startswith("score") for k in actor[0])
    shutil.rmtree(out)


def same_state(a: Any, b: Any) -> bool:
    """Nested state dicts equal, tensors bit for bit."""
    if isinstance(a, dict):
        return isinstance(b, dict) and sorted(a) == sorted(b) and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


# --------------------------------------------------------------------------- plan()

RULES = [
    (["--algo.adv-estimator", "gae", "--actor.engine", "megatron"], 1,
     "algo.adv_estimator=gae trains a critic (a value model), which actor.engine=megatron does not build: use "
     "--actor.engine fsdp, or a group estimator (--algo.adv-estimator grpo)"),
    (["--critic.model.path", "tiny-random"], 1,
     "critic.model.path=tiny-random is set but algo.adv_estimator=grpo trains no critic: set --algo.adv-estimator "
     "gae or unset --critic.model.path"),
]


@pytest.mark.parametrize("flags,world,message", RULES, ids=[r[2][:48] for r in RULES])
def test_plan_rule_message(flags: list[str], world: int, message: str) -> None:
    cfg = load_config(flags)
    with pytest.raises(ValueError, match=re.escape(message)):
        plan(cfg, world)


def test_kl_in_the_reward_and_in_the_loss_is_a_warning() -> None:
    ppo = ["--algo.adv-estimator", "gae", "--algo.kl-in-reward"]
    assert plan(load_config([*ppo, "--algo.no-use-kl-loss"]), 2).warnings == ()
    message = ("algo.kl_in_reward and algo.use_kl_loss are both on: the KL to the reference counts twice, in the "
               "reward and in the actor's loss; PPO's usual setting is --algo.use-kl-loss false")
    assert plan(load_config(ppo), 2).warnings == (message,)
