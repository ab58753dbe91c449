"""Partial rollouts in the built-in engine (in process, tiny random Llama, CPU): responses interrupted
by a weight swap continue from their prefix, and every token's log-prob is that of the weights that
sampled it (recomputed with the Hugging Face forward of each set of weights); forced response
lengths (``rollout.length_dist``) are the drawn ones.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from support.numerics import perturbed_copy
from transformers import LlamaConfig, LlamaForCausalLM

from spmd_rl.models import load_causal_lm
from spmd_rl.rollout import NativeRollout
from spmd_rl.rollout.lengths import draw_lengths

VOCAB = 101
TEMPERATURE = 0.9


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict, dict]:
    root = tmp_path_factory.mktemp("partial")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(root / "v0")
    v1 = perturbed_copy(str(root / "v0"), root / "v1", scale=0.05, seed=1)
    v2 = perturbed_copy(str(root / "v0"), root / "v2", scale=0.05, seed=2)
    return str(root), v1, v2


@cache
def model_of(folder: str) -> torch.nn.Module:
    return load_causal_lm(folder, dtype=torch.float32)


def recomputed(folder: str, prompt: list[int], response: list[int]) -> torch.Tensor:
    """``log_softmax(logits / T)`` of the response tokens under the model of ``folder``."""
    model = model_of(folder)
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "hf"])
def test_interrupted_responses_continue_under_the_new_weights(folders, fast: bool) -> None:
    root, v1, v2 = folders
    engine = NativeRollout(f"{root}/v0", device=torch.device("cpu"), dtype=torch.float32, batch_size=4, pad_token_id=0,
                           eos_token_ids=[VOCAB], fast_decode=fast, length_dist="lognormal", min_new_tokens=4)
    assert (engine._fast is not None) == fast
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (k,), generator=gen).tolist() for k in (5, 9, 3, 7, 6, 4)]
    calls, swapped_at = [], []

    def swap() -> bool:
        """New weights at the 2nd look (inside the first piece) and at the 6th."""
        calls.append(1)
        new = {2: v1, 6: v2}.get(len(calls))
        if new is None:
            return False
        engine.load_weights(new.items())
        swapped_at.append(len(calls))
        return True

    out = engine.generate(prompts, n=2, temperature=TEMPERATURE, top_p=1.0, top_k=0, max_new_tokens=16, seed=5,
                          swap=swap, swap_every=4)
    assert swapped_at == [2, 6]
    lengths = out.response_lengths.tolist()
    assert lengths == draw_lengths("lognormal", count=12, low=4, high=16, seed=5)  # forced, prompt-major
    assert out.truncated.all()  # no EOS: each row stopped at its drawn length
    folder_of = {0: f"{root}/v0", 1: f"{root}/v1", 2: f"{root}/v2"}
    mixed = 0
    for row in range(12):
        k = lengths[row]
        response = out.response_ids[row, :k].tolist()
        swaps = out.weight_swaps[row, :k]
        assert swaps.tolist() == sorted(swaps.tolist())  # a row's tokens: older weights first
        mixed += int(swaps[0] != swaps[-1])
        for version in swaps.unique().tolist():
            expected = recomputed(folder_of[version], out.prompt_ids[row], response)
            at = swaps == version
            torch.testing.assert_close(out.logprobs[row, :k][at], expected[at], atol=2e-5, rtol=0)
    # the first piece's rows were interrupted after 8 tokens and went on under v1
    assert mixed >= 2, out.weight_swaps
