"""Prefix reuse across turns (spmd_rl/rollout/prefixes.py; CPU, fp32, tiny random models).

Rows are played as multi-turn episodes on one stream: each finished row is fed again under its key
with its tokens and a few "environment" tokens appended, three turns each. With ``keep_prefixes`` a
turn continues from the K/V its previous turn left parked; the greedy tokens must equal those of the
same episodes prefilled whole every turn, the log-probs within 1e-5, with an EOS that ends rows at
different steps, with episodes fed again after different delays (the live rows compact while others
wait parked: the parked K/V moves with them), with fewer slots than episodes (new rows evict parked
ones), and on a sliding-window model (which never parks). An ended episode, new weights and
``forget_prefixes`` drop what is parked.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_rollout_fast import VOCAB, build, early_eos, engine, greedy, random_prompts, responses

TURNS = 3


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("prefix_models")


def env_tokens(key: int, turn: int) -> list[int]:
    """What the "environment" answers episode ``key`` after its turn ``turn``: a few fixed token ids."""
    gen = torch.Generator().manual_seed(100 * key + turn)
    return torch.randint(3, VOCAB, (2 + (key + turn) % 4,), generator=gen).tolist()


def play(e, prompts: list[list[int]], *, keep: bool, max_new_tokens: int = 6, delay_s: float = 0.0,
         temperature: float = 0.0, seed: int = 0) -> dict[int, list]:
    """Every prompt as a ``TURNS``-turn episode on ``e``'s stream, greedy unless ``temperature``;
    ``{key: [(tokens, logprobs) per turn]}``. ``delay_s``: episode ``key`` is fed again ``delay_s x (1 +
    key % 3)`` after its turn (an environment that takes its time: the others decode, compact and
    refill meanwhile)."""
    import threading
    import time

    ids = {k: list(p) for k, p in enumerate(prompts)}
    pending = list(ids)
    turns: dict[int, list] = {k: [] for k in ids}
    waiting = []

    def feed(k: int):
        taken, pending[:] = pending[:k], pending[k:]
        return [(key, ids[key]) for key in taken]

    def done(key, tokens, logprobs, swaps, truncated):
        turns[key].append((tokens.tolist(), logprobs.clone()))
        if len(turns[key]) < TURNS:
            ids[key] += tokens.tolist() + env_tokens(key, len(turns[key]))
            if delay_s:
                waiting.append(threading.Timer(delay_s * (1 + key % 3), pending.append, (key,)))
                waiting[-1].start()
            else:
                pending.append(key)
        elif keep:
            e.forget_prefixes(key)  # the episode ended

    longest = max(len(p) for p in prompts) + TURNS * (max_new_tokens + 6)
    while pending or any(t.is_alive() for t in waiting):
        if not pending:
            time.sleep(0.002)
            continue
        e.stream(feed=feed, done=done, temperature=temperature, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens,
                 max_prompt_length=longest, seed=seed, keep_prefixes=keep)
    return turns


def same_episodes(got: dict, ref: dict) -> None:
    for key in ref:
        assert [t for t, _ in got[key]] == [t for t, _ in ref[key]], f"episode {key}: tokens differ"
        for turn, ((_, a), (_, b)) in enumerate(zip(got[key], ref[key])):
            gap = (a - b).abs().max().item()
            assert gap < 1e-5, f"episode {key}, turn {turn}: log-probs differ by {gap}"


@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen3-gqa-qknorm"])
def test_turns_continue_from_the_parked_prefix_and_equal_whole_prefills(root: Path, name: str) -> None:
    folder = build(root, name)
    prompts = random_prompts([5, 11, 3, 8], seed=4)
    eos = early_eos(responses(greedy(engine(folder, fast=False), prompts)))  # rows end at different steps
    ref = play(engine(folder, eos=eos), prompts, keep=False)
    e = engine(folder, eos=eos)
    got = play(e, prompts, keep=True)
    same_episodes(got, ref)
    fast = e._fast
    # turns 2 and 3 of every episode that kept its slot reused the whole turn before it
    assert e.reused_tokens > 0 and fast.compactions + fast.refills > 0
    assert len({p.slot for p in fast.parked.values()}) == len(fast.parked) <= fast.cache.shape[2]


def test_parked_prefixes_move_with_a_compaction(root: Path) -> None:
    """Episodes fed again after different delays on 8 slots: the live rows compact while others wait
    parked; the parked K/V moves with them and every turn still equals a whole prefill."""
    folder = build(root, "qwen3-gqa-qknorm")
    prompts = random_prompts([5, 11, 3], seed=8)
    ref = play(engine(folder, batch_size=8), prompts, keep=False, max_new_tokens=24)
    e = engine(folder, batch_size=8)
    got = play(e, prompts, keep=True, max_new_tokens=24, delay_s=0.15)
    same_episodes(got, ref)
    reused = sum(len(p) + 23 + (len(p) + 24 + len(env_tokens(k, 1)) + 23) for k, p in enumerate(prompts))
    assert e._fast.compactions > 0 and e.reused_tokens == reused  # every later turn reused its whole prefix


def test_fewer_slots_than_episodes_evict_and_stay_exact(root: Path) -> None:
    folder = build(root, "qwen3-gqa-qknorm")
    prompts = random_prompts([4, 9, 6, 2, 7], seed=5)
    ref = play(engine(folder, batch_size=2), prompts, keep=False)
    e = engine(folder, batch_size=2)
    same_episodes(play(e, prompts, keep=True), ref)
    assert len(e._fast.parked) <= 2  # a parked slot is a free slot: new rows took them over


def test_sliding_window_models_prefill_whole_turns(root: Path) -> None:
    folder = build(root, "gemma3-window")
    prompts = random_prompts([5, 9], seed=6)
    ref = play(engine(folder), prompts, keep=False)
    e = engine(folder)
    assert not e._fast.can_park
    same_episodes(play(e, prompts, keep=True), ref)
    assert e.reused_tokens == 0 and not e._fast.parked


def test_new_weights_and_forget_drop_what_is_parked(root: Path) -> None:
    folder = build(root, "llama-gqa-untied")
    e = engine(folder)
    play(e, random_prompts([5, 7], seed=7), keep=True)
    assert not e._fast.parked and e.reused_tokens > 0  # every episode ended: its slot is empty again

    def one_turn() -> None:
        rows = [(k, p) for k, p in enumerate(random_prompts([5, 7], seed=9))]
        e.stream(feed=lambda k: [rows.pop() for _ in range(min(k, len(rows)))], done=lambda *a: None,
                 temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=4, max_prompt_length=16, seed=0,
                 keep_prefixes=True)

    one_turn()
    assert sorted(e._fast.parked) == [0, 1]  # finished, not told they ended: parked
    e.load_weights([(name, p.detach().clone()) for name, p in e.model.named_parameters()][:1])
    assert not e._fast.parked
    one_turn()
    e.forget_prefixes(0)
    assert sorted(e._fast.parked) == [1]
    e.forget_prefixes()
    assert not e._fast.parked


READ_BACKS = {"aten::nonzero", "aten::_local_scalar_dense", "aten::item", "aten::masked_select", "aten::is_nonzero"}
"""Ops that make the host wait for the device (on CUDA: a sync), as the profiler names them."""


def test_prefills_and_extensions_never_read_the_device_back(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn's prefill and extension are launched layer after layer without waiting for the device:
    their indices come from the host, where the lengths are known (a boolean-mask index per layer made
    the host wait twice per layer between turns, while the decode step waited for it)."""
    from torch.profiler import ProfilerActivity, profile

    folder = build(root, "qwen3-gqa-qknorm")
    prompts = random_prompts([5, 11, 3, 8], seed=4)
    e = engine(folder)
    fast, seen = e._fast, {}

    def watch(name: str) -> None:
        fn = getattr(fast, name)

        def watched(*args):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                out = fn(*args)
            seen.setdefault(name, set()).update(evt.key for evt in prof.key_averages())
            return out

        monkeypatch.setattr(fast, name, watched)

    watch("_prefill")
    watch("_extend_group")
    ref = play(engine(folder), prompts, keep=False)
    same_episodes(play(e, prompts, keep=True), ref)
    for name in ("_prefill", "_extend_group"):
        assert "aten::embedding" in seen.get(name, ()), (name, seen)  # the profile saw it run
        assert not seen[name] & READ_BACKS, (name, sorted(seen[name] & READ_BACKS))


def test_sampled_episodes_do_not_depend_on_the_schedule(root: Path) -> None:
    """Sampling (T = 1): a row draws from its own uniforms (seeded by the stream's seed, its key and its
    prompt's length), so the same episodes sample the same tokens on 8 slots or 2, fed again at once
    or after delays (an environment's, or a busy machine's), with prefix reuse or whole prefills; another
    seed samples others."""
    folder = build(root, "qwen3-gqa-qknorm")
    prompts = random_prompts([5, 11, 3, 8], seed=4)
    args = dict(temperature=1.0, max_new_tokens=8)
    ref = play(engine(folder, batch_size=8), prompts, keep=True, **args)
    for slots, keep, delay_s in [(2, True, 0.05), (8, True, 0.1), (4, False, 0.0)]:
        same_episodes(play(engine(folder, batch_size=slots), prompts, keep=keep, delay_s=delay_s, **args), ref)
    other = play(engine(folder, batch_size=8), prompts, keep=True, seed=1, **args)
    assert [t for k in ref for t, _ in ref[k]] != [t for k in other for t, _ in other[k]]
    assert len({tuple(t) for k in ref for t, _ in ref[k]}) > 1  # the turns sampled different tokens
