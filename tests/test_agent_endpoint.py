"""The OpenAI-compatible endpoint for black-box agents (spmd_rl/episodes/agent.py), on CPU with a
tiny random model: the ``openai`` client drives a 2-turn agent, its tokens are the episode's
(the replies it read are the model's tokens decoded, the follow-up only appended) and the actor's
log-probs of them equal the rollout's; bad requests get HTTP errors with a message while the round
goes on; under ``spmd_rl.train`` the agent's episodes are trained on, colocated and on a rollout pool.

Prefix reuse: every follow-up that continues its episode prefills only its new tokens over the K/V its
first turn left parked, counted exactly (the engine's ``reused_tokens``): with replies cut by the
request's ``max_tokens``, with requests that come one by one while a slowed engine decodes (the
schedule of a loaded machine), and with more agents than slots; a follow-up whose history the agent
rewrote is prefilled whole. The actor's log-probs equal the rollout's in each case."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import torch

from spmd_rl.distributed.testing import run_distributed
from test_train_e2e import _check, launch, read_metrics

SAMPLING = dict(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8, seed=3)
ERRORS: list[tuple[int, str]] = []
"""What bad_requests got back for its malformed requests."""


DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Requests straight to the loopback endpoint, whatever ``HTTP_PROXY`` says."""


def _post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with DIRECT.open(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def bad_requests(client, row: dict) -> float:
    """Sends malformed requests first (each must get an error), then one good one."""
    base = str(client.base_url).rstrip("/")
    codes = [_post(f"{base}/chat/completions", body) for body in (
        b"{not json", json.dumps({"messages": []}).encode(), json.dumps({"messages": [{"role": "user", "content": "x"}],
                                                                          "n": 2}).encode())]
    codes.append(_post(base.replace("/e/", "/e/nobody-") + "/chat/completions",
                       json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode()))
    ERRORS.extend((code, body["error"]["message"]) for code, body in codes)
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=4)
    return float(reply.choices[0].message.content is not None)


def _run(rank: int, world_size: int) -> dict:
    import sys

    from conftest import HERE

    sys.path.insert(0, HERE)
    from support import agents
    from support.episodes import actor_logprobs, tiny_rollout

    from spmd_rl.episodes.agent import AgentRunner, load_agent

    folder, tok, eos, pad, engine = tiny_rollout()
    runner = AgentRunner(load_agent("support.agents:two_turns"), tokenizer=tok, eos_ids=eos, max_turns=4,
                         max_tokens=64, workers=4, skip_errors=False)
    reused = engine.reused_tokens
    out = runner.run(engine, [{"answer": "7"}, {"answer": "12"}], n=2, sampling=SAMPLING)
    reused = engine.reused_tokens - reused
    logprobs = actor_logprobs(out, folder, pad)
    model_texts = [[tok.decode(ids[(mask == 1) & (seg == k)].tolist(), skip_special_tokens=True) for k in (0, 1)]
                   for ids, mask, seg in zip(out["response_ids"], out["response_mask"], _turn_of(out))]
    bad = AgentRunner(bad_requests, tokenizer=tok, eos_ids=eos, max_turns=4, max_tokens=64, workers=1,
                      skip_errors=False)
    bad_out = bad.run(engine, [{"answer": "1"}], n=1, sampling=SAMPLING)
    return {"out": out, "logprobs": logprobs, "seen": agents.SEEN, "texts": model_texts, "errors": ERRORS,
            "bad_reward": bad_out["env_reward"].tolist(), "reused": reused}


def _run_schedules(rank: int, world_size: int) -> dict:
    """The same 2-turn agent on a slowed engine with requests that come one by one (4 slots), with
    more agents than slots (2 slots, 4 agents), with a prompt longer than the stream call's rows, and
    an agent that rewrites its history: each round's rows, the reused tokens and the actor's log-probs."""
    import sys

    from conftest import HERE

    sys.path.insert(0, HERE)
    from support.episodes import actor_logprobs, tiny_rollout

    from spmd_rl.episodes.agent import AgentRunner, load_agent

    # 4 slots: 7 parks and thinks, 8 decodes alone (the two compact into 2 slots), then 9 comes
    late = [{"answer": "7", "think": 0.6}, {"answer": "8", "delay": 0.1}, {"answer": "9", "delay": 0.3},
            {"answer": "10", "delay": 0.5, "think": 0.2}]
    # 2 slots: 7 and 8 both think when 9 and 10 come: these wait for an episode to end
    crowded = [{"answer": "7", "think": 0.6}, {"answer": "8", "delay": 0.05, "think": 0.6},
               {"answer": "9", "delay": 0.3}, {"answer": "10", "delay": 0.3}]
    # 7's first request starts a stream call sized for it; 8's, longer than that call's rows may be,
    # comes while 7 decodes: it waits for the next call, whose cache grows (7's parked K/V moves over)
    long = [{"answer": "7", "think": 0.6}, {"answer": "7 " * 60, "delay": 0.05}]
    rounds = {"late": ("late_two_turns", 4, late), "crowded": ("late_two_turns", 2, crowded),
              "long": ("late_two_turns", 4, long),
              "edited": ("edits_history", 4, [{"answer": "7"}, {"answer": "12"}])}
    got = {}
    for name, (fn, slots, rows) in rounds.items():
        folder, tok, eos, pad, engine = tiny_rollout(batch_size=slots)
        engine.token_delay_s = 0.02  # a slow decode step: the agents' requests come while rows decode
        runner = AgentRunner(load_agent(f"support.agent_schedules:{fn}"), tokenizer=tok, eos_ids=eos, max_turns=4,
                             max_tokens=64, workers=4, skip_errors=False)
        out = runner.run(engine, rows, n=1, sampling=SAMPLING)
        got[name] = {"out": out, "reused": engine.reused_tokens, "logprobs": actor_logprobs(out, folder, pad),
                     "slots": engine._fast.cache.shape[3]}
    return got


def _turn_of(out: dict) -> torch.Tensor:
    """Each response token's model turn (0, 1, ...): context tokens start a new one."""
    context = out["context_mask"]
    return torch.cumsum(torch.nn.functional.pad(context[:, :-1] * (1 - context[:, 1:]), (1, 0)), dim=1)


def test_the_openai_client_drives_a_two_turn_agent_and_its_tokens_are_trained_on(monkeypatch) -> None:
    # a cluster's proxy settings (here a port where nothing listens) do not reach the agents' clients:
    # they talk to this process's loopback endpoint directly
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    got = run_distributed(_run, 1)[0]
    out = got["out"]
    assert out["env_turns"].tolist() == [2, 2, 2, 2] and out["env_reward"].tolist() == [0.5] * 4
    assert out["agent_restarts"].tolist() == [0, 0, 0, 0]  # each follow-up continued the episode's tokens
    model, context = out["response_mask"], out["context_mask"]
    assert (model * context).sum() == 0 and context.sum() > 0
    assert sorted(tuple(s["replies"]) for s in got["seen"]) == sorted(tuple(t) for t in got["texts"])
    assert all(s["usage"][k] <= 5 for s in got["seen"] for k in (0, 1))  # max_tokens honoured
    gap = ((got["logprobs"] - out["logprobs"]).abs() * model).max().item()
    assert gap < 1e-5, gap
    # each follow-up prefilled only its new tokens: its first turn's K/V (the prompt and every reply
    # token but the last; the replies were cut at max_tokens=5 of the round's 8) was parked under it
    assert got["reused"] == _first_turns(out) > 0
    assert out["env_reused_tokens"].sum() == got["reused"]  # per episode in the rows (env/prefill_reused_frac)
    codes = [code for code, _ in got["errors"]]
    assert codes == [400, 400, 400, 404], got["errors"]
    assert "not JSON" in got["errors"][0][1] and "`n` must be 1" in got["errors"][2][1]
    assert got["bad_reward"] == [1.0]  # the round went on after the bad requests


def _first_turns(out: dict) -> int:
    """The tokens each episode's second turn reuses: its prompt and its first reply but the last token."""
    first = ((_turn_of(out) == 0) & (out["response_mask"] == 1)).sum(1)
    return int((out["prompt_lengths"] + first - 1).sum())


def _exact(got: dict) -> None:
    out = got["out"]
    gap = ((got["logprobs"] - out["logprobs"]).abs() * out["response_mask"]).max().item()
    assert gap < 1e-5, gap


def test_follow_ups_reuse_their_first_turn_whatever_the_schedule_and_an_edited_history_is_prefilled_whole() -> None:
    got = run_distributed(_run_schedules, 1)[0]
    for name in ("late", "crowded", "long"):  # every follow-up found its first turn parked
        out = got[name]["out"]
        episodes = len(out["env_turns"])
        assert out["env_turns"].tolist() == [2] * episodes and out["agent_restarts"].tolist() == [0] * episodes
        assert got[name]["reused"] == _first_turns(out) > 0, name
        _exact(got[name])
    assert got["long"]["out"]["prompt_lengths"].max() > 64 and got["long"]["slots"] > 128  # the cache grew
    edited = got["edited"]
    out = edited["out"]
    assert out["agent_restarts"].tolist() == [1, 1] and edited["reused"] == 0  # nothing parked was its prefix
    assert ((_turn_of(out) == 0) * out["response_mask"]).sum() == out["response_mask"].sum() > 0  # the last turn only
    _exact(edited)


def test_an_agent_under_train(tmp_path) -> None:
    out = str(tmp_path / "run")
    _check(launch(out, "--agent.fn", "support.agents:two_turns", "--env.max-tokens", "64",
                  "--rollout.max-new-tokens", "6", "--data.train-batch-size", "4", "--rollout.n", "2",
                  "--actor.ppo-mini-batch-size", "4", "--trainer.total-steps", "2"))
    steps = [m for m in read_metrics(out) if "env/turns/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["env/turns/mean"] == 2 and abs(m["critic/score/mean"] - 0.5) < 1e-6


def test_an_agent_on_a_rollout_pool(tmp_path) -> None:
    """The endpoint is served by the rollout pool's rank, which plays the agent's episodes there."""
    out = str(tmp_path / "run")
    _check(launch(out, "--agent.fn", "support.agents:two_turns", "--env.max-tokens", "64",
                  "--rollout.max-new-tokens", "6", "--data.train-batch-size", "4", "--rollout.n", "2",
                  "--actor.ppo-mini-batch-size", "4", "--trainer.total-steps", "2", "--pools.rollout-ranks", "1"))
    steps = [m for m in read_metrics(out) if "env/turns/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["env/turns/mean"] == 2 and abs(m["critic/score/mean"] - 0.5) < 1e-6
