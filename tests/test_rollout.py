"""Tests for the native rollout engine against plain Hugging Face references.

Run with ``python3 -m pytest tests/test_rollout.py -q -s`` (``-s`` shows the measured log-prob
differences). Most tests use the ``tiny-random`` model; one parity test uses SmolLM2, found in the
same shared cache as tests/test_models.py (``$SPMD_RL_CACHE`` or ``.pytest_cache/d/spmd_rl_models``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from spmd_rl.models import load_causal_lm, load_tokenizer, resolve_model_path
from spmd_rl.models.builtin import SMOLLM2_NAME
from spmd_rl.rollout import GenerationOutput, NativeRollout, RolloutEngine, build_rollout
from spmd_rl.rollout.native import filter_logits, sample_next
from support import deps
from support.devices import cuda
from support.numerics import perturbed_copy

DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]
MESSAGES = ["What is 2+3?", "Hi", "Please add 17 and 25, then explain the result in words.", "7*8?"]
SAMPLING = dict(temperature=0.7, top_p=1.0, top_k=0, max_new_tokens=24)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return resolve_model_path("tiny-random", cache_dir=str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def tok(folder: str):
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def prompts(tok) -> list[list[int]]:
    return [tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                    tokenize=True)["input_ids"] for m in MESSAGES]


def make_engine(folder: str, tok, device: str = "cpu", batch_size: int = 16, eos: list[int] | None = None) -> NativeRollout:
    return NativeRollout(folder, device=torch.device(device), dtype=torch.float32, batch_size=batch_size,
                         pad_token_id=tok.pad_token_id, eos_token_ids=eos or [tok.eos_token_id])


def responses(out: GenerationOutput) -> list[list[int]]:
    return [row[mask.bool()].tolist() for row, mask in zip(out.response_ids, out.response_mask)]


def teacher_forced_logprobs(model, out: GenerationOutput, temperature: float) -> torch.Tensor:
    """Independent recomputation: right-padded prompt+response, log_softmax(logits / T) at each response token."""
    rows = [p + r for p, r in zip(out.prompt_ids, responses(out))]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)], attn[i, :len(r)] = torch.tensor(r), 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits.float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    result = torch.zeros_like(out.logprobs)
    for i, (p, r) in enumerate(zip(out.prompt_ids, responses(out))):
        positions = torch.arange(len(p) - 1, len(p) - 1 + len(r))  # logits at t predict token t+1
        result[i, :len(r)] = logp[i, positions, torch.tensor(r, dtype=torch.long)]
    return result


# --------------------------------------------------------------------------- (a) greedy parity


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch_size", [16, 3])
def test_greedy_matches_hf_generate_per_prompt(folder: str, tok, prompts, device: str, batch_size: int) -> None:
    engine = make_engine(folder, tok, device, batch_size)
    out = engine.generate(prompts, n=2, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=24, seed=0)
    model = load_causal_lm(folder, dtype=torch.float32).to(device)
    for i, p in enumerate(prompts):
        ids = torch.tensor([p], device=device)  # alone: no padding at all
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
        for j in range(2):
            assert responses(out)[i * 2 + j] == ref, f"prompt {i} copy {j}"
    assert out.prompt_ids == [p for p in prompts for _ in range(2)]


def test_outputs_can_enter_the_trainers_autograd_graph(folder: str, tok, prompts) -> None:
    out = make_engine(folder, tok).generate(prompts, n=2, seed=0, **SAMPLING)
    assert all(not t.is_inference() and t.device.type == "cpu"
               for t in (out.response_ids, out.response_mask, out.logprobs, out.truncated))
    new_logprobs = out.logprobs.clone().requires_grad_(True)
    ratio = torch.exp(new_logprobs - out.logprobs)  # PPO ratio against the rollout's log-probs
    (ratio * out.response_mask).sum().backward()  # mask is saved for backward: no inference tensors allowed
    assert torch.equal(new_logprobs.grad, out.response_mask)


# --------------------------------------------------------------------------- (b) log-prob parity


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (20, 0.9)])
def test_sampling_logprobs_match_teacher_forced_forward(folder: str, tok, prompts, top_k: int, top_p: float) -> None:
    out = make_engine(folder, tok).generate(prompts, n=4, temperature=0.7, top_p=top_p, top_k=top_k,
                                            max_new_tokens=24, seed=3)
    ref = teacher_forced_logprobs(load_causal_lm(folder, dtype=torch.float32), out, 0.7)
    mask = out.response_mask.bool()
    diff = (out.logprobs - ref).abs()[mask]
    print(f"\ntiny-random log-prob parity (T=0.7, top_k={top_k}, top_p={top_p}): mean abs diff "
          f"{diff.mean():.2e}, max {diff.max():.2e} over {mask.sum()} tokens")
    assert diff.mean() <= 1e-4 and diff.max() <= 1e-3
    assert (out.logprobs[~mask] == 0).all() and (out.logprobs[mask] < 0).all()


@deps.smollm2
def test_sampling_logprobs_match_on_smollm2(pytestconfig: pytest.Config, tmp_path_factory) -> None:
    cache = os.environ.get("SPMD_RL_CACHE") or (
        str(pytestconfig.cache.mkdir("spmd_rl_models")) if getattr(pytestconfig, "cache", None)
        else str(tmp_path_factory.mktemp("spmd_rl_models")))
    folder = resolve_model_path(SMOLLM2_NAME, cache_dir=cache)
    tok = load_tokenizer(folder)
    prompts = [tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                       tokenize=True)["input_ids"] for m in ("What is 7 + 5?", "Name a colour.")]
    engine = make_engine(folder, tok)
    out = engine.generate(prompts, n=2, temperature=0.7, top_p=1.0, top_k=0, max_new_tokens=12, seed=0)
    diff = (out.logprobs - teacher_forced_logprobs(engine.model, out, 0.7)).abs()[out.response_mask.bool()]
    print(f"\nsmollm2 log-prob parity (T=0.7): mean abs diff {diff.mean():.2e}, max {diff.max():.2e}")
    assert diff.mean() <= 1e-4


# --------------------------------------------------------------------------- (c) seeds


def test_same_seed_same_outputs_different_seed_differs(folder: str, tok, prompts) -> None:
    engine = make_engine(folder, tok, batch_size=5)
    a = engine.generate(prompts, n=3, seed=11, **SAMPLING)
    b = engine.generate(prompts, n=3, seed=11, **SAMPLING)
    c = engine.generate(prompts, n=3, seed=12, **SAMPLING)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)
    assert len({tuple(r) for r in responses(a)[:3]}) > 1  # the n samples of one prompt differ


# --------------------------------------------------------------------------- (d) EOS, masks, truncation


def test_eos_stops_rows_and_masks(folder: str, tok, prompts) -> None:
    greedy = dict(temperature=0.0, top_p=1.0, top_k=0, seed=0)
    free = make_engine(folder, tok).generate(prompts, n=1, max_new_tokens=20, **greedy)
    row0 = responses(free)[0]
    stop_at = next(t for t in range(2, 20) if row0[t] not in row0[:t])  # first occurrence of that token
    eos = row0[stop_at]
    out = make_engine(folder, tok, eos=[eos]).generate(prompts, n=1, max_new_tokens=20, **greedy)
    for i, ref in enumerate(responses(free)):
        got = responses(out)[i]
        if eos in ref:
            cut = ref.index(eos) + 1
            assert got == ref[:cut] and not out.truncated[i]  # EOS token kept, masked 1
        else:
            assert got == ref and out.truncated[i] and len(got) == 20
        length = len(got)
        assert out.response_mask[i, :length].eq(1).all() and out.response_mask[i, length:].eq(0).all()
        assert out.response_ids[i, length:].eq(tok.pad_token_id).all()
        assert out.logprobs[i, length:].eq(0).all()
    assert out.response_lengths[0] == stop_at + 1

    # When every row stops early, the batch stops and T is the longest response.
    single = make_engine(folder, tok, eos=[row0[0]]).generate(prompts[:1], n=2, max_new_tokens=20, **greedy)
    assert single.response_ids.shape == (2, 1) and not single.truncated.any()


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "hf-loop"])
def test_no_eos_ids_run_every_row_to_max_new_tokens(folder: str, tok, prompts, fast: bool) -> None:
    """``eos_token_ids=[]`` (``rollout.ignore_eos``): no row stops early, even one that samples EOS."""
    engine = NativeRollout(folder, device=torch.device("cpu"), dtype=torch.float32, batch_size=16,
                           pad_token_id=tok.pad_token_id, eos_token_ids=[], fast_decode=fast)
    free = make_engine(folder, tok).generate(prompts, n=1, max_new_tokens=20, temperature=0.0, top_p=1.0, top_k=0,
                                             seed=0)
    out = engine.generate(prompts, n=1, max_new_tokens=20, temperature=0.0, top_p=1.0, top_k=0, seed=0)
    assert out.response_mask.eq(1).all() and out.truncated.all() and out.response_ids.shape == (len(prompts), 20)
    for ref, got in zip(responses(free), responses(out)):
        assert got[:len(ref)] == ref  # the same greedy tokens, past any EOS too
    first = make_engine(folder, tok, eos=[responses(free)[0][0]])  # an "EOS" the first row samples at once
    assert first.generate(prompts[:1], n=1, max_new_tokens=20, temperature=0.0, top_p=1.0, top_k=0,
                          seed=0).response_ids.shape == (1, 1)



def test_ignore_eos_gives_the_engine_no_eos_ids(folder: str, tok) -> None:
    from spmd_rl.config import RolloutConfig
    from spmd_rl.rollout import build_rollout_from_config

    for ignore in (False, True):
        engine = build_rollout_from_config(RolloutConfig(ignore_eos=ignore), model_folder=folder,
                                           device=torch.device("cpu"), pad_token_id=tok.pad_token_id,
                                           eos_token_ids=[tok.eos_token_id], trust_remote_code=False,
                                           max_prompt_length=64, seed=0)
        assert engine.eos_token_ids == ([] if ignore else [tok.eos_token_id])


def test_generation_output_checks_shapes() -> None:
    with pytest.raises(ValueError, match=r"GenerationOutput.logprobs has shape \(2, 3\), expected \(2, 4\)"):
        GenerationOutput(prompt_ids=[[1], [1]], response_ids=torch.zeros(2, 4, dtype=torch.long),
                         response_mask=torch.zeros(2, 4), logprobs=torch.zeros(2, 3),
                         truncated=torch.zeros(2, dtype=torch.bool))


# --------------------------------------------------------------------------- (e) load_weights


def test_load_weights_changes_outputs_and_equals_fresh_model(folder: str, tok, prompts, tmp_path: Path) -> None:
    engine = make_engine(folder, tok)
    before = engine.generate(prompts, n=2, seed=5, **SAMPLING)
    engine.load_weights(perturbed_copy(folder, tmp_path, scale=0.5).items())
    after = engine.generate(prompts, n=2, seed=5, **SAMPLING)
    assert not torch.equal(before.response_ids, after.response_ids)
    fresh = make_engine(str(tmp_path), tok).generate(prompts, n=2, seed=5, **SAMPLING)
    assert torch.equal(after.response_ids, fresh.response_ids) and torch.equal(after.logprobs, fresh.logprobs)

    with pytest.raises(KeyError, match=r"unknown weight 'model.nope'.*such as \['model.embed_tokens.weight'"):
        engine.load_weights([("model.nope", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(3,\), the rollout model expects \(64,\)"):
        engine.load_weights([("model.norm.weight", torch.zeros(3))])


def test_load_weights_tied_embeddings_accept_either_name(folder: str, tok, tmp_path: Path) -> None:
    model = load_causal_lm(folder, dtype=torch.float32)
    model.config.tie_word_embeddings = True
    type(model)(model.config).save_pretrained(tmp_path)
    engine = make_engine(str(tmp_path), tok)
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    new = torch.randn(engine.model.lm_head.weight.shape, dtype=torch.bfloat16)  # cast on copy
    engine.load_weights([("lm_head.weight", new)])
    assert torch.equal(engine.model.model.embed_tokens.weight, new.float())
    engine.load_weights([("model.embed_tokens.weight", new * 2)])
    assert torch.equal(engine.model.lm_head.weight, (new * 2).float())


# --------------------------------------------------------------------------- (f) sleep / wake_up


def reload_if_dropped(engine, saved: dict[str, torch.Tensor], device: str) -> None:
    """On the CPU a level-2 sleep drops the weights (a host copy would be a second copy): the engine
    refuses to wake until every parameter is loaded again, as the trainer's next sync does."""
    if device != "cpu":
        assert not engine.needs_weights
        return
    assert engine.needs_weights and engine.model.model.embed_tokens.weight.untyped_storage().nbytes() <= 8
    with pytest.raises(RuntimeError, match="dropped the weights"):
        engine.wake_up()
    engine.load_weights(list(saved.items())[:1])
    assert engine.needs_weights  # one parameter is not all of them
    engine.load_weights(saved.items())
    assert not engine.needs_weights


@pytest.mark.parametrize("device", DEVICES)
def test_sleep_wake_round_trip_keeps_outputs(folder: str, tok, prompts, device: str) -> None:
    engine = make_engine(folder, tok, device)
    ref = engine.generate(prompts, n=2, seed=1, **SAMPLING)
    weight = engine.model.model.embed_tokens.weight
    storage = weight.data_ptr()
    saved = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    engine.sleep(2)
    assert weight.device.type == "cpu" and weight.data_ptr() != storage  # weights really moved out
    with pytest.raises(RuntimeError, match=r"asleep \(level 2\); call wake_up\(\) first"):
        engine.generate(prompts, n=1, seed=1, **SAMPLING)
    reload_if_dropped(engine, saved, device)
    engine.wake_up()
    assert weight.device.type == torch.device(device).type
    again = engine.generate(prompts, n=2, seed=1, **SAMPLING)
    assert torch.equal(ref.response_ids, again.response_ids) and torch.equal(ref.logprobs, again.logprobs)
    engine.sleep(1)
    engine.wake_up()
    engine.sleep(2)
    engine.sleep(2)  # idempotent
    reload_if_dropped(engine, saved, device)
    engine.wake_up()
    assert torch.equal(engine.generate(prompts, n=2, seed=1, **SAMPLING).response_ids, ref.response_ids)
    engine.sleep(0)  # keeps everything: no wake-up needed
    assert torch.equal(engine.generate(prompts, n=2, seed=1, **SAMPLING).response_ids, ref.response_ids)
    with pytest.raises(ValueError, match="rollout.sleep_level must be 0, 1 or 2, got 3"):
        engine.sleep(3)
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate(prompts, n=1, seed=1, **SAMPLING)


# --------------------------------------------------------------------------- sampling helpers, factory, errors


def test_filter_logits_top_k_and_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    keep = lambda x: torch.isfinite(x)[0].tolist()  # noqa: E731
    assert keep(filter_logits(logits, top_k=2, top_p=1.0)) == [True, True, False, False]
    assert keep(filter_logits(logits, top_k=0, top_p=0.5)) == [True, False, False, False]
    assert keep(filter_logits(logits, top_k=0, top_p=0.6)) == [True, True, False, False]
    assert keep(filter_logits(logits, top_k=0, top_p=0.9)) == [True, True, True, False]
    assert keep(filter_logits(logits, top_k=3, top_p=0.1)) == [True, False, False, False]


def test_sample_next_draws_from_the_filtered_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs).expand(20000, 4)
    gen = torch.Generator().manual_seed(0)
    tokens, logprobs = sample_next(logits, temperature=1.0, top_k=3, top_p=1.0, generator=gen)
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95, atol=0.015, rtol=0)
    torch.testing.assert_close(logprobs, torch.log(probs)[tokens])  # unfiltered log-probs
    greedy, lp = sample_next(logits[:2] * 3, temperature=0.0, top_k=0, top_p=1.0, generator=gen)
    assert greedy.tolist() == [0, 0]
    torch.testing.assert_close(lp, torch.log_softmax(logits[:2] * 3, -1)[:, 0])  # T = 1 when greedy


def test_build_rollout_and_argument_errors(folder: str, tok, prompts) -> None:
    engine = build_rollout("native", model_folder=folder, device=torch.device("cpu"), dtype=torch.float32,
                           batch_size=4, pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id])
    assert isinstance(engine, NativeRollout) and isinstance(engine, RolloutEngine)
    with pytest.raises(ValueError, match=r"rollout.backend='sglang' is not available; known backends: \['native', 'vllm'\]"):
        build_rollout("sglang")
    args = dict(n=1, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4, seed=0)
    for bad, match in [({"n": 0}, "rollout.n must be >= 1, got 0"),
                       ({"temperature": -1.0}, "rollout.temperature must be >= 0"),
                       ({"top_p": 0.0}, r"rollout.top_p must be in \(0, 1\], got 0.0"),
                       ({"top_k": -2}, "rollout.top_k must be >= 0, got -2"),
                       ({"max_new_tokens": 0}, "rollout.max_new_tokens must be >= 1, got 0"),
                       ({"max_new_tokens": 600}, r"rollout.max_new_tokens \(600\) exceeds the model's "
                                                 r"max_position_embeddings \(512\)")]:
        with pytest.raises(ValueError, match=match):
            engine.generate(prompts, **dict(args, **bad))
    with pytest.raises(ValueError, match=r"prompts \[1\] are empty"):
        engine.generate([[5], []], **args)
