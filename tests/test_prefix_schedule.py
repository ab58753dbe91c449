"""Which parked prefixes a stream keeps (spmd_rl/rollout/prefixes.py, slots.py), on a schedule of
events, not of time: rows are fed at given feed calls or after given rows finished (on the CPU the
stream checks for finished rows, and asks its feed, after every decode step), so each test plays
the same way on an idle and on a loaded machine. CPU, fp32, tiny random models, greedy.

A prefix parked in a stream survives: a new row that arrives after the live rows compacted (it takes
an empty slot: the bucket grows rather than evict), a new stream call, and a cache that grows for
longer rows (the parked K/V is carried over). Only when every slot of the largest bucket is live or
parked does a new row take one, the longest-parked. Every turn's tokens and log-probs equal those of
the same rows prefilled whole (``keep_prefixes=False``), and the reused tokens are counted exactly.
"""

from __future__ import annotations

import pytest
import torch
from test_rollout_fast import VOCAB, build, engine, random_prompts


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build(tmp_path_factory.mktemp("schedule_models"), "qwen3-gqa-qknorm")


def more(key: str, turn: int) -> list[int]:
    """What follows row ``key``'s turn ``turn`` before its next one: a few fixed token ids."""
    gen = torch.Generator().manual_seed(1000 * turn + sum(map(ord, key)))
    return torch.randint(3, VOCAB, (3,), generator=gen).tolist()


class Script:
    """A stream's feed on a schedule: ``(key, limit, when)`` per turn, ``when`` a feed call number or
    ``("after", key, extra)``: ``extra`` feed calls after ``key``'s last turn finished. A row's next
    turn feeds its prompt, every turn so far and ``more`` after each."""

    def __init__(self, prompts: dict[str, list[int]]) -> None:
        self.ids = {k: list(p) for k, p in prompts.items()}
        self.turns: dict[str, list[tuple[list[int], torch.Tensor]]] = {k: [] for k in prompts}
        self.plan: list[tuple[str, int, object]] = []
        self.calls, self.finished_at = 0, {}

    def add(self, key: str, limit: int, when: object) -> "Script":
        self.plan.append((key, limit, when))
        return self

    def _due(self, when: object) -> bool:
        if isinstance(when, int):
            return self.calls >= when
        _, key, extra = when
        return key in self.finished_at and self.calls >= self.finished_at[key] + extra

    def feed(self, k: int) -> list[tuple[str, list[int], int]]:
        self.calls += 1
        due = [p for p in self.plan if self._due(p[2])][:k]
        for p in due:
            self.plan.remove(p)
        return [(key, list(self.ids[key]), limit) for key, limit, _ in due]

    def done(self, key, tokens, logprobs, swaps, truncated) -> None:
        self.turns[key].append((tokens.tolist(), logprobs.clone()))
        self.ids[key] += tokens.tolist() + more(key, len(self.turns[key]))
        self.finished_at[key] = self.calls

    def run(self, e, *, keep: bool, longest: int = 40, max_new_tokens: int = 6) -> None:
        """One stream call that plays what is planned now (its schedule's feed calls count from 1)."""
        self.calls, self.finished_at = 0, {}
        e.stream(feed=self.feed, done=self.done, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens,
                 max_prompt_length=longest, seed=0, keep_prefixes=keep)


def parked_length(s: Script, key: str, turn: int) -> int:
    """The tokens row ``key``'s turn ``turn`` (0-based) reuses when it continues from the turn before:
    the previous turn's prompt and every token of it but the last."""
    prompt = len(s.ids[key]) - sum(len(t) + 3 for t, _ in s.turns[key])  # the first prompt
    before = sum(len(t) + 3 for t, _ in s.turns[key][:turn - 1])
    return prompt + before + len(s.turns[key][turn - 1][0]) - 1


def same_turns(got: Script, ref: Script) -> None:
    for key in ref.turns:
        assert [t for t, _ in got.turns[key]] == [t for t, _ in ref.turns[key]], f"{key}: tokens differ"
        for turn, ((_, a), (_, b)) in enumerate(zip(got.turns[key], ref.turns[key])):
            gap = (a - b).abs().max().item()
            assert gap < 1e-5, f"{key}, turn {turn}: log-probs differ by {gap}"


def fresh(folder: str, batch_size: int):
    e = engine(folder, batch_size=batch_size)
    e._fast.check_every = 1  # a check (and a feed call) after every step, also where graphs would make it 4
    return e


def play(folder: str, batch_size: int, prompts: dict[str, list[int]], calls: list, *, keep: bool):
    """Each of ``calls`` is ``(plan, longest)``: the turns planned for one stream call."""
    e, s = fresh(folder, batch_size), Script(prompts)
    for plan, longest in calls:
        for turn in plan:
            s.add(*turn)
        s.run(e, keep=keep, longest=longest)
        assert not s.plan, f"not fed: {s.plan}"
    return e, s


def test_a_new_row_after_a_compaction_takes_an_empty_slot_not_a_parked_one(folder: str) -> None:
    """A ends first and parks, B goes on alone: the live and parked rows compact into 2 of the 4 slots.
    C arrives then: the bucket grows and C takes an empty slot (before: C took A's parked slot, so A's
    next turn, fed after it, was prefilled whole: the schedule of a loaded machine, where the first
    requests come in one by one)."""
    prompts = dict(zip("ABC", random_prompts([5, 7, 6], seed=11)))
    calls = [([("A", 2, 1), ("B", 6, 1), ("C", 4, ("after", "A", 2)), ("A", 3, ("after", "A", 4))], 40)]
    _, ref = play(folder, 4, prompts, calls, keep=False)
    e, got = play(folder, 4, prompts, calls, keep=True)
    same_turns(got, ref)
    assert e._fast.compactions > 0
    assert e.reused_tokens == parked_length(got, "A", 1) == 5 + 2 - 1


def test_parked_prefixes_survive_a_new_stream_call_and_a_growing_cache(folder: str) -> None:
    """Each turn in its own stream call (an agent endpoint's requests between calls); the third call's
    rows are longer, so the cache grows (its slots pass a multiple of 64): what is parked moves over."""
    prompts = dict(zip("AB", random_prompts([5, 9], seed=12)))
    calls = [([("A", 3, 1), ("B", 5, 1)], 40), ([("B", 4, 1), ("A", 2, 1)], 40), ([("A", 6, 1), ("B", 6, 1)], 100)]
    _, ref = play(folder, 4, prompts, calls, keep=False)
    e, got = play(folder, 4, prompts, calls, keep=True)
    same_turns(got, ref)
    assert e._fast.cache.shape[3] == 128  # grew from 64: 100 + 6 rounded up to 64
    assert e.reused_tokens == sum(parked_length(got, k, t) for k in "AB" for t in (1, 2))
    assert sorted(e._fast.parked) == ["A", "B"]


def test_with_every_slot_taken_a_new_row_evicts_the_longest_parked(folder: str) -> None:
    """2 slots, A and B parked (A first) when C arrives in the next call: C takes A's slot (the
    longest-parked), B's next turn reuses its prefix, A's is prefilled whole, and all stay exact."""
    prompts = dict(zip("ABC", random_prompts([5, 9, 4], seed=13)))
    calls = [([("A", 2, 1), ("B", 4, 1)], 40),
             ([("C", 3, 1), ("B", 3, ("after", "C", 0)), ("A", 3, ("after", "C", 0))], 40)]
    _, ref = play(folder, 2, prompts, calls, keep=False)
    e, got = play(folder, 2, prompts, calls, keep=True)
    same_turns(got, ref)
    assert e.reused_tokens == parked_length(got, "B", 1) == 9 + 4 - 1  # B's; A's prefix was evicted by C
