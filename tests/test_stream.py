"""Streaming generation (spmd_rl/rollout/stream.py; CPU, fp32, tiny random models): rows fed while
others decode and handed back as each finishes, on the fast path and on the Hugging Face loop.

A stream whose feed trickles 16 rows in (a few at every look) on 2 slots must give each row the
tokens a plain greedy ``generate`` gives it (greedy does not depend on batching), with an EOS that
ends rows early so that slots free at different steps, rows return in the order they finish, a
compaction and a regrow happen, and sampled log-probs equal a teacher-forced recomputation. With
weight swaps mid-stream, each token's log-prob is that of the weights that sampled it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.numerics import perturbed_copy
from test_partial import TEMPERATURE, recomputed
from test_rollout_fast import build, early_eos, engine, greedy, random_prompts, responses

LENGTHS = [5, 13, 2, 9, 17, 7, 11, 3]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stream_models")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(LENGTHS, seed=3)


def trickle(prompts: list[list[int]], n: int, per_look: int):
    """A feed that gives at most ``per_look`` rows a look (rows keyed ``(prompt, j)``), and a sink."""
    pending = [((i, j), p) for i, p in enumerate(prompts) for j in range(n)]
    looks, got = [0], {}

    def feed(k: int):
        looks[0] += 1
        out, pending[:] = pending[:min(k, per_look)], pending[min(k, per_look):]
        return out

    def done(key, tokens, logprobs, swaps, truncated):
        assert key not in got, f"{key} finished twice"
        got[key] = (tokens.tolist(), logprobs, swaps.tolist(), truncated)

    return feed, done, got, looks


def test_stream_rows_equal_greedy_generate_and_come_back_as_they_finish(root: Path, prompts) -> None:
    """The fast path (the HF loop's waves are checked by the swap test)."""
    fast = True
    folder = build(root, "qwen3-gqa-qknorm")
    eos = early_eos(responses(greedy(engine(folder, fast=False), prompts)))
    ref = greedy(engine(folder, fast=False, eos=eos), prompts)  # rows prompt-major, n = 2
    e = engine(folder, fast=fast, eos=eos, batch_size=2)
    feed, done, got, looks = trickle(prompts, 2, per_look=1)
    order = []
    swaps = e.stream(feed=feed, done=lambda key, *a: (order.append(key), done(key, *a)), temperature=0.0, top_p=1.0,
                     top_k=0, max_new_tokens=20, max_prompt_length=max(LENGTHS), seed=0)
    assert swaps == 0 and len(got) == 16 and looks[0] > 8  # the feed was asked again and again
    for r, (i, j) in enumerate((i, j) for i in range(len(prompts)) for j in range(2)):
        tokens, _, _, truncated = got[(i, j)]
        assert tokens == responses(ref)[r], (i, j)
        assert truncated == bool(ref.truncated[r])
    assert order != sorted(order)  # rows return by when they finish, not by when they were fed
    assert e._fast.refills > 0


def test_stream_sampled_logprobs_and_a_compaction_with_regrow(root: Path, prompts) -> None:
    """Sampled (T = 0.9): each row's log-probs equal the HF forward's; the feed goes dry (the batch
    compacts) and then gives rows again (the batch grows back)."""
    folder = build(root, "qwen2-gqa-tied")
    e = engine(folder, batch_size=4)
    pending = [((i, j), p) for i, p in enumerate(prompts) for j in range(3)]
    looks, got = [0], {}

    def feed(k: int):
        looks[0] += 1
        if 3 <= looks[0] <= 5:  # dry for a while: the live rows compact into a smaller bucket
            return []
        out, pending[:] = pending[:k], pending[k:]
        return out

    def done(key, tokens, logprobs, swaps, truncated):
        got[key] = (tokens.tolist(), logprobs)

    lengths = {}
    e.length_dist, e.min_new_tokens = "uniform", 4
    e.stream(feed=feed, done=done, temperature=TEMPERATURE, top_p=1.0, top_k=0, max_new_tokens=16,
             max_prompt_length=max(LENGTHS), seed=4)
    assert len(got) == 24 and e._fast.compactions > 0
    for (i, j), (tokens, logprobs) in got.items():
        lengths[(i, j)] = len(tokens)
        torch.testing.assert_close(logprobs, recomputed(folder, prompts[i], tokens), atol=2e-5, rtol=0)
    assert len(set(lengths.values())) > 3  # drawn lengths, not one


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "hf"])
def test_stream_weight_swaps_continue_rows_under_the_new_weights(root: Path, prompts, tmp_path: Path,
                                                                 fast: bool) -> None:
    folder = build(root, "llama-gqa-untied")
    v1 = perturbed_copy(folder, tmp_path / "v1", scale=0.05, seed=1)
    v2 = perturbed_copy(folder, tmp_path / "v2", scale=0.05, seed=2)
    e = engine(folder, fast=fast, batch_size=4)
    calls = []

    def swap() -> bool:
        calls.append(1)
        new = {2: v1, 5: v2}.get(len(calls))
        if new is not None:
            e.load_weights(new.items())
        return new is not None

    feed, done, got, _ = trickle(prompts, 2, per_look=3)
    swaps = e.stream(feed=feed, done=done, temperature=TEMPERATURE, top_p=1.0, top_k=0, max_new_tokens=24,
                     max_prompt_length=max(LENGTHS), seed=5, swap=swap, swap_every=4)
    assert swaps == 2 and len(got) == 16
    folder_of = {0: folder, 1: str(tmp_path / "v1"), 2: str(tmp_path / "v2")}
    mixed = 0
    for (i, j), (tokens, logprobs, versions, _) in got.items():
        assert len(tokens) == 24 and versions == sorted(versions)
        mixed += int(versions[0] != versions[-1])
        for v in set(versions):
            at = torch.tensor(versions) == v
            expected = recomputed(folder_of[v], prompts[i], tokens)
            torch.testing.assert_close(logprobs[at], expected[at], atol=2e-5, rtol=0)
    assert mixed >= 2
