"""Reward model on a separate reward pool (and colocated): scores, failures, the real entry point.

* 3 processes (2 global + 1 reward) and 4 (2 + 2): the scores that come back through the pool
  exchange equal those of the same reward model in one process (no FSDP, one row at a time);
  uneven and empty row lists, several rounds. With 3 processes a test scorer then raises on the
  reward rank: the global ranks raise ``RewardError`` naming it and the server returns 1. With 4,
  a global rank aborts mid-round: the other gets the error and both reward ranks return 1.
* colocated (``pools.reward_ranks=0``, 2 processes): the same scores through ``build_run_reward``.
* ``torchrun -m spmd_rl.train --pools.reward-ranks 1 --reward.model.path tiny-random-rm``: a short
  GRPO run completes (one validation prompt: a global rank with none still takes part in the
  round); total score = rule + weight x model score; the rank table shows the pools.
* a reward model whose vocabulary is too small for the actor's token ids (the documented test
  hook: a real model folder that fails when scoring) stops all ranks with its error within
  seconds, far below ``--trainer.dist-timeout-s 60``.

Run: ``python -m pytest tests/test_reward_pool.py -q``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import HERE, REPO
from spmd_rl.config import ActorConfig, Config, DataConfig, PoolsConfig, RewardConfig, RewardModelConfig, load_config
from spmd_rl.distributed.testing import cpu_env, free_port, run_distributed, run_program

CACHE = os.environ["SPMD_RL_CACHE"]
RM = RewardModelConfig(path="tiny-random-rm", micro_batch_size=2)


def _rows(global_rank: int, round_: int) -> list[list[int]]:
    """Deterministic token rows of different lengths; rank 1's second round is empty. Some rows
    end with id 0, the pad id: they must still be scored at their last token."""
    if round_ == 1 and global_rank == 1:
        return []
    g = torch.Generator().manual_seed(100 * global_rank + round_)
    count = 5 if global_rank == 0 else 2
    rows = [torch.randint(0, 100, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]
    rows[0][-1] = 0
    return rows


def reference_scores(rows: list[list[int]]) -> list[float]:
    """One process, no FSDP, no padding: the head's output at each row's last token."""
    from spmd_rl.models import load_reward_model
    from spmd_rl.reward.model import resolve_reward_model

    model = load_reward_model(resolve_reward_model(RM, cache_dir=CACHE), dtype=torch.float32)
    with torch.no_grad():
        return [model.score(model.model(torch.tensor([r])).last_hidden_state)[0, -1, 0].item() for r in rows]


class FailsOnSeven:
    """A test scorer for the server: the reward model, except that a row starting with 7, 7, 7 raises."""

    def __init__(self, model) -> None:
        self.model = model
        self.micro_batch_size = model.micro_batch_size

    def check(self, rows) -> None:
        self.model.check(rows)

    def score(self, rows, *, num_micro_batches):
        if any(r[:3] == [7, 7, 7] for r in rows):
            raise ArithmeticError("test scorer exploded on 7 7 7")
        return self.model.score(rows, num_micro_batches=num_micro_batches)


def _setup(reward_ranks: int, world_size: int):
    from spmd_rl.plan import plan
    from spmd_rl.distributed.env import DistEnv
    from spmd_rl.world import build_run_groups

    env = DistEnv.from_environ().init(device="cpu")
    cfg = Config(pools=PoolsConfig(reward_ranks=reward_ranks), data=DataConfig(train_batch_size=2),
                 actor=ActorConfig(ppo_mini_batch_size=2), reward=RewardConfig(fn="none", model=RM))
    return env, build_run_groups(plan(cfg, world_size), env, close_timeout_s=10)


def pool_body(rank: int, world_size: int, reward_ranks: int, failure: str) -> dict:
    """Two scoring rounds, then ``failure``: ``scorer`` (the reward rank raises in round 3) or
    ``abort`` (global rank 1 fails before round 3, and rank 0 still sends its rows)."""
    from spmd_rl.reward.model import RewardModel, resolve_reward_model
    from spmd_rl.reward.registry import RewardError
    from spmd_rl.reward.server import RemoteModelReward, RewardServer

    env, groups = _setup(reward_ranks, world_size)
    table = groups.rank_table
    if groups.in_reward_pool:
        def build():
            model = RewardModel(folder=resolve_reward_model(RM, cache_dir=CACHE), mesh=groups.reward_mesh,
                                device=env.device, micro_batch_size=RM.micro_batch_size)
            return FailsOnSeven(model)

        code = RewardServer(link=groups.exchange, group=groups.pools.get("reward").group, build=build).serve()
        return {"role": "reward", "code": code, "table": table}
    client = RemoteModelReward(groups.exchange)
    scores = [client.score(_rows(rank, r)) for r in range(2)]
    error = None
    if failure == "abort":
        if rank == 1:  # fails outside scoring; the entry point's exception path tells the reward pool
            error = "RuntimeError: boom in the update"
            groups.exchange.close(error)
        # rank 1's abort has reached both reward ranks before rank 0 sends its next rows
        torch.distributed.barrier(group=groups.pools.get("global").group)
    if error is None:
        try:
            client.score([[7, 7, 7, 5]] if failure == "scorer" else _rows(rank, 0))
        except RewardError as e:
            error = f"{type(e).__name__}: {e}"
            groups.exchange.close(error)
    groups.exchange.close()
    return {"role": "global", "scores": scores, "error": error, "table": table}


@pytest.mark.parametrize("world_size,reward_ranks,failure", [(3, 1, "scorer"), (4, 2, "abort")])
def test_reward_pool_scores_match_one_process(world_size: int, reward_ranks: int, failure: str) -> None:
    out = run_distributed(pool_body, world_size, reward_ranks, failure, timeout_s=60)
    glob, rew = out[:world_size - reward_ranks], out[world_size - reward_ranks:]
    for rank, res in enumerate(glob):
        for round_, got in enumerate(res["scores"]):
            want = reference_scores(_rows(rank, round_))
            assert len(got) == len(want)
            assert got == pytest.approx(want, abs=1e-5), (rank, round_)
    assert all(r["code"] == 1 for r in rew)  # the run failed: reward ranks exit non-zero
    if failure == "scorer":
        for res in glob:
            assert res["error"].startswith("RewardError: ")
            assert "reward rank 2" in res["error"] and "ArithmeticError: test scorer exploded on 7 7 7" in res["error"]
    else:
        assert glob[1]["error"] == "RuntimeError: boom in the update"
        assert glob[0]["error"].startswith("RewardError: ")
        assert "global rank 1: RuntimeError: boom in the update" in glob[0]["error"]
    pools = [row["pools"] for row in out[0]["table"]]
    assert pools[:2] == [{"global": 0}, {"global": 1}]
    assert pools[2:] == [{"reward": i} for i in range(reward_ranks)]


def colocated_body(rank: int, world_size: int, fresh_cache: str) -> list[list[float]]:
    from spmd_rl.data.tasks import Sample
    from spmd_rl.models import load_tokenizer
    from spmd_rl.reward.model import resolve_reward_model
    from spmd_rl.reward.run import build_run_reward
    from support.tiny import tiny_model_folder

    env, groups = _setup(0, world_size)
    assert groups.exchange is None
    if rank == 1:  # a built-in built by a rank other than 0 still gets its weights (transformers >= 5)
        built = Path(tiny_model_folder(fresh_cache, seed=5, reward_model=True))
        assert (built / "model.safetensors").is_file() and (built / "config.json").is_file()
    tok = load_tokenizer(resolve_reward_model(RM, cache_dir=CACHE))
    reward = build_run_reward(reward=RewardConfig(fn="none", model=RM), task="arithmetic", system_prompt=None,
                              actor_tokenizer=tok, group=groups.pools.get("global").group, mesh=groups.actor_mesh,
                              exchange=None, device=env.device, cache_dir=CACHE)
    assert reward.inputs.mode == "ids"
    out = []
    for round_ in range(2):
        rows = _rows(rank, round_)
        # ids mode: prompt ids + response ids; split each row anywhere, it is joined back
        samples = [Sample(prompt="p", answer="0") for _ in rows]
        result = reward(samples, ["c"] * len(rows), [r[:2] for r in rows], [r[2:] for r in rows])
        assert result.model_scores == result.scores  # fn none: the model score alone
        out.append(result.scores)
    return out


def test_colocated_reward_model_same_scores(tmp_path: Path) -> None:
    out = run_distributed(colocated_body, 2, str(tmp_path), timeout_s=60)
    for rank, rounds in enumerate(out):
        for round_, got in enumerate(rounds):
            assert got == pytest.approx(reference_scores(_rows(rank, round_)), abs=1e-5), (rank, round_)


def test_text_input_renders_the_rm_chat_template() -> None:
    from spmd_rl.data.prompts import render_prompts
    from spmd_rl.data.tasks import Sample
    from spmd_rl.models import load_tokenizer
    from spmd_rl.reward.model import RewardInputs, resolve_reward_model

    tok = load_tokenizer(resolve_reward_model(RM, cache_dir=CACHE))
    samples = [Sample(prompt="What is 2+3?", answer="5"), Sample(prompt="1+1?", answer="2")]
    _, prompt_ids, _ = render_prompts(samples, tok, system_prompt="Be brief.", max_prompt_length=100)
    completions = ["5", "two"]
    response_ids = [tok.encode(c, add_special_tokens=False) + [tok.eos_token_id] for c in completions]
    kw = dict(actor_tokenizer=tok, rm_tokenizer=tok, system_prompt="Be brief.", max_length=100)
    ids = RewardInputs.choose(input="auto", **kw)
    text = RewardInputs.choose(input="text", **kw)
    assert ids.mode == "ids" and text.mode == "text"
    # a response that ends with EOS reads the same both ways with the shared template
    assert ids.rows(samples, prompt_ids, response_ids, completions) == text.rows(samples, prompt_ids, response_ids,
                                                                                 completions)
    assert tok.decode(text.rows(samples, prompt_ids, response_ids, completions)[1]) == \
        "<|system|>Be brief.</s><|user|>1+1?</s><|assistant|>two</s>"
    short = RewardInputs.choose(input="ids", **dict(kw, max_length=4)).rows(samples, prompt_ids, response_ids, completions)
    assert short[1] == (prompt_ids[1] + response_ids[1])[-4:]  # keeps the end, where the score is read


def test_config_rules_and_entry_point_check(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ValueError, match="reward.fn=none scores every response 0: set --reward.model.path"):
        load_config(["--reward.fn", "none"])
    with pytest.raises(ValueError, match="reward.model.micro_batch_size must be >= 1, got 0"):
        load_config(["--reward.model.path", "x", "--reward.model.micro-batch-size", "0"])
    cfg = load_config(["--reward.model.path", "tiny-random-rm", "--reward.model.weight", "0.5", "--reward.fn", "none"])
    assert cfg.reward.model.weight == 0.5
    from spmd_rl.train import main

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    flags = ["--pools.reward-ranks", "1", "--data.train-batch-size", "2", "--actor.ppo-mini-batch-size", "2"]
    assert main(flags) == 2
    assert "pools.reward_ranks=1 makes a reward pool, but reward.model.path is not set" in capsys.readouterr().err
    # another rank waits first (so that torchrun cannot stop rank 0 before it reports), then reports too
    import spmd_rl.train as train_module

    waits: list[float] = []
    monkeypatch.setattr(train_module.time, "sleep", waits.append)
    monkeypatch.setenv("RANK", "1")
    assert main(flags) == 2
    assert waits == [train_module.REPORT_GRACE_S]
    assert "invalid configuration (rank 1): pools.reward_ranks=1 makes a reward pool" in capsys.readouterr().err


# --------------------------------------------------------------------------- the real entry point

TINY = [
    "--model.path", "tiny-random", "--data.task", "arithmetic", "--data.train-batch-size", "4",
    "--data.val-size", "1", "--rollout.n", "4", "--rollout.max-new-tokens", "6", "--actor.ppo-mini-batch-size", "4",
    "--actor.micro-batch-size", "16", "--algo.kl-coef", "0.0", "--logging.wandb", "off", "--logging.no-console",
    "--checkpoint.no-save-final", "--trainer.dist-timeout-s", "300", "--trainer.stall-timeout-s", "30", "--pools.reward-ranks", "1",
]


def torchrun(out_dir: str, *flags: str, timeout: int) -> subprocess.CompletedProcess:
    env = cpu_env(PYTHONPATH=os.pathsep.join([REPO, HERE]), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port", str(free_port()),
           "-m", "spmd_rl.train", *TINY, "--trainer.output-dir", out_dir, *flags]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    return proc


def test_grpo_with_reward_pool(tmp_path: Path) -> None:
    import json

    out = str(tmp_path / "run")
    proc = run_program("spmd_rl.train", [*TINY, "--trainer.output-dir", out, "--trainer.total-steps", "2",
                                         "--trainer.val-every", "2", "--reward.model.path", "tiny-random-rm",
                                         "--reward.model.weight", "2.0", "--reward.fn", "support.rewards:digit_fraction"],
                       nproc=3, env=dict(PYTHONPATH=os.pathsep.join([REPO, HERE]), OMP_NUM_THREADS="1"), cwd=REPO,
                       timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-6000:]}"
    with open(os.path.join(out, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    steps = [m for m in metrics if "critic/score/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:  # total = rule + weight * model, per response, so also in the mean
        assert m["critic/score/mean"] == pytest.approx(m["reward/rule_score/mean"] + 2.0 * m["reward/model_score/mean"],
                                                       abs=1e-5)
        assert m["reward/model_score/mean"] != 0.0
    assert [m["step"] for m in metrics if "val/score" in m] == [0, 2]
    table = proc.stderr[proc.stderr.index("rank table"):]
    assert re.search(r"^1 .* global:1$", table, re.M) and re.search(r"^2 .* reward:0$", table, re.M), table[:800]


def test_reward_pool_failure_stops_every_rank(tmp_path: Path) -> None:
    """Test hook: a real reward-model folder whose vocabulary (10 ids) is smaller than the actor's
    token ids, so every scoring call fails on the reward rank."""
    from transformers import LlamaForSequenceClassification

    from spmd_rl.models.builtin import TinyShape, tiny_random_config
    from spmd_rl.models.tokenizer import build_char_tokenizer

    folder = tmp_path / "small-vocab-rm"
    config = tiny_random_config(TinyShape(), vocab_size=10)
    config.num_labels = 1
    LlamaForSequenceClassification(config).save_pretrained(folder)
    build_char_tokenizer().save_pretrained(folder)
    proc = torchrun(str(tmp_path / "err"), "--trainer.total-steps", "3", "--trainer.val-every", "0",
                           "--reward.model.path", str(folder), timeout=600)
    assert proc.returncode != 0
    err = proc.stderr
    assert "RewardError: the reward model failed on the reward pool" in err, err[-6000:]
    assert "reward rank 2 (" in err and "outside the reward model's vocabulary of 10 tokens" in err
    # the job is stopped by the error itself, not by a collective's timeout on the other ranks
    assert "Timed out" not in err
