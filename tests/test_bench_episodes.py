"""``bench/episodes.py`` on CPU, the tiny shape: every case counts every model token of its episodes,
and only the multi-turn case with reuse prefills less."""

from __future__ import annotations

import importlib.util
import os

import torch

from conftest import REPO

_spec = importlib.util.spec_from_file_location("bench_episodes", os.path.join(REPO, "bench", "episodes.py"))
bench_episodes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_episodes)


def test_episodes_bench_counts_every_token_and_reuses_only_with_prefixes(tmp_path):
    engine = bench_episodes.build_engine("tiny", 4, torch.device("cpu"), str(tmp_path / "tiny"))
    prompts = [[5 + i] * (6 + i) for i in range(4)]
    args = dict(new_tokens=5, env_tokens=3, tool_s=0.002, workers=2, vocab=512)
    got = {keep: bench_episodes.play(engine, prompts, turns=3, keep=keep, **args) for keep in (True, False)}
    for keep in (True, False):
        assert got[keep]["tokens"] == 4 * 3 * 5 and 0 <= got[keep]["idle"] < got[keep]["wall"]
    before = engine.reused_tokens
    bench_episodes.play(engine, prompts, turns=3, keep=False, **args)
    assert engine.reused_tokens == before
    bench_episodes.play(engine, prompts, turns=3, keep=True, **args)
    # 4 episodes on 4 slots: turns 2 and 3 reuse the whole turn before (its prefix and its tokens but
    # the last), also when rows waiting for their tool let the live ones compact
    assert engine.reused_tokens - before == sum((len(p) + 4) + (len(p) + 5 + 3 + 4) for p in prompts)
    assert engine.reused_tokens == 2 * (engine.reused_tokens - before)
