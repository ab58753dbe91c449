"""FP8 rollout weights (``--rollout.dtype fp8``, :mod:`spmd_rl.rollout.fp8`).

Run with ``python3 -m pytest tests/test_rollout_fp8.py -q``. On the CPU (both operands quantised and
multiplied dequantised: the numbers of the CUDA scaled GEMM up to the accumulation order), and on a GPU
where one is present:

* quantising a weight row by row and back stays within e4m3's rounding; rows quantise alone as in the
  whole tensor; an all-zero row is exact;
* the FP8 product equals the product of the two quantised operands (the CUDA scaled GEMM too, for
  row counts of a decode step and of a prefill, with and without a bias), within two e4m3 roundings of
  the exact one;
* the rollout computes exactly the quantised model: its log-probs equal those of Hugging Face's
  forward with the dequantised weights and each projection's input quantised per token;
* a weight load re-quantises the loaded rows and changes nothing else (the same weights: the same
  bytes; new weights: what an engine built from them generates); a level-2 sleep and a load give
  the same generation back;
* plan() refuses FP8 where the backend cannot, warns without a rollout correction, and the memory
  estimate counts one byte per projection weight; a short run logs the log-prob gap it makes.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

from spmd_rl.rollout.fp8 import E4M3_MAX, dequantize_rows, fp8_linear, quantize_rows
from support.devices import cuda

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=True)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]


def folder_of(root: Path, seed: int = 0, **shape) -> str:
    folder = root / f"qwen3-{seed}"
    if not (folder / "config.json").exists():
        torch.manual_seed(seed)
        Qwen3ForCausalLM(Qwen3Config(**{**SHAPE, **shape})).save_pretrained(folder)
    return str(folder)


def engine_of(folder: str, *, fp8: bool = True, batch_size: int = 4, device: str = "cpu", dtype=torch.float32):
    from spmd_rl.rollout.native import NativeRollout

    return NativeRollout(folder, device=torch.device(device), dtype=dtype, batch_size=batch_size, pad_token_id=0,
                         eos_token_ids=[1], fp8=fp8)


def generate(engine, seed: int = 3, temperature: float = 1.0):
    return engine.generate(PROMPTS, n=2, temperature=temperature, top_p=1.0, top_k=0, max_new_tokens=10, seed=seed)


def test_quantising_rows_stays_within_e4m3_rounding() -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 80) * torch.logspace(-3, 2, 48)[:, None]  # rows of very different sizes
    w[7] = 0.0
    q, scale = quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (48,) and scale.dtype == torch.float32
    back = dequantize_rows(q, scale)
    # e4m3: 3 mantissa bits (half a step: 2^-4 relative); below 2^-6 subnormal steps of 2^-9 (in units of scale)
    bound = torch.maximum(w.abs() * 2 ** -4, scale[:, None] * 2 ** -10) * (1 + 1e-6)
    assert ((back - w).abs() <= bound).all()
    assert torch.equal(back[7], torch.zeros(80)) and scale[7] == 1.0
    assert torch.allclose(q.float().abs().amax(-1)[torch.arange(48) != 7], torch.tensor(E4M3_MAX))  # full range
    # one scale per row: a row quantises alone as in the whole tensor (rows loaded apart)
    q2, s2 = quantize_rows(w[10:20])
    assert torch.equal(q2.view(torch.uint8), q[10:20].view(torch.uint8)) and torch.equal(s2, scale[10:20])


def _quantised_product(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    xq, xs = quantize_rows(x.reshape(-1, x.shape[-1]).float())  # the activations' per-token rounding
    return (dequantize_rows(xq, xs) @ dequantize_rows(q, scale).T).view(*x.shape[:-1], -1)


def test_the_fp8_product_is_the_product_of_the_quantised_operands() -> None:
    torch.manual_seed(1)
    x, w, b = torch.randn(3, 5, 64) * 3, torch.randn(96, 64) / 8, torch.randn(96)
    q, scale = quantize_rows(w)
    y = fp8_linear(x, q, scale, b)
    assert y.shape == (3, 5, 96) and y.dtype == x.dtype
    assert torch.allclose(y, _quantised_product(x, q, scale) + b, rtol=1e-5, atol=1e-5)
    # two e4m3 roundings per product: |error| <= ((1 + 2^-4)^2 - 1) |x| @ |w|.T (normal numbers)
    err = (y - F.linear(x, w, b)).abs()
    assert (err <= 0.13 * (x.abs() @ w.abs().T) + 1e-5).all()
    assert err.max() > 0  # the quantisation is real


@cuda
@pytest.mark.parametrize("rows", [1, 7, 64, 200, 3000])  # decode buckets, an odd count, a prefill
@pytest.mark.parametrize("bias", [False, True])
def test_the_cuda_scaled_gemm_equals_the_quantised_product(rows: int, bias: bool) -> None:
    torch.manual_seed(2)
    w = torch.randn(4608, 576, device="cuda") / 20  # SmolLM2's gate/up
    x = torch.randn(rows, 576, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4608, device="cuda", dtype=torch.bfloat16) if bias else None
    q, scale = quantize_rows(w)
    got = fp8_linear(x, q, scale, b).float()
    want = _quantised_product(x, q, scale) + (0 if b is None else b.float())
    assert got.shape == (rows, 4608)
    assert ((got - want).abs() <= 1e-2 * want.abs() + 2e-2).all()  # bf16 output rounding, fp32 accumulation


def _quantised_reference(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` computing what the FP8 rollout does: every projection's weight quantised and back,
    its input quantised per token and back."""
    ref = copy.deepcopy(model)

    def quantise_input(module, args):
        x = args[0]
        xq, xs = quantize_rows(x.reshape(-1, x.shape[-1]))
        return (dequantize_rows(xq, xs).view_as(x).to(x.dtype),)

    for layer in ref.model.layers:
        for name in PROJECTIONS:
            lin = getattr(layer.self_attn, name, None) or getattr(layer.mlp, name)
            lin.weight.data = dequantize_rows(*quantize_rows(lin.weight.data)).to(lin.weight.dtype)
            lin.register_forward_pre_hook(quantise_input)
    return ref


def _logprobs_of(model: torch.nn.Module, g) -> tuple[torch.Tensor, torch.Tensor]:
    """``model``'s log-probs of every generated token of ``g`` (temperature 1), with the rollout's."""
    mine, theirs = [], []
    for i, prompt in enumerate(g.prompt_ids):
        n = int(g.response_mask[i].sum())
        ids = torch.tensor([prompt + g.response_ids[i, :n].tolist()])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        theirs.append(logp[len(prompt) - 1:-1].gather(-1, ids[0, len(prompt):, None]).squeeze(-1))
        mine.append(g.logprobs[i, :n])
    return torch.cat(mine), torch.cat(theirs)


def test_the_rollout_computes_the_quantised_model(tmp_path: Path) -> None:
    folder = folder_of(tmp_path)
    model = Qwen3ForCausalLM.from_pretrained(folder).eval()
    engine = engine_of(folder)
    assert engine._fast.fp8_units == len(engine._fast.fused) == 8  # q/k/v, o, gate/up, down in both layers
    g = generate(engine)
    rollout, quantised = _logprobs_of(_quantised_reference(model), g)
    assert (rollout - quantised).abs().max() < 2e-5
    _, plain = _logprobs_of(model, g)
    assert (rollout - plain).abs().max() > 1e-3  # FP8 is not the model's own precision
    # the projections' weights no longer hold memory; the rest of the model is untouched
    q_proj = engine.model.model.layers[0].self_attn.q_proj.weight
    assert q_proj.shape == (64, 64) and q_proj.untyped_storage().nbytes() == 4
    assert torch.equal(engine.model.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_a_weight_load_requantises_and_changes_nothing_else(tmp_path: Path) -> None:
    old, new = folder_of(tmp_path, 0), folder_of(tmp_path, 1)
    engine = engine_of(old)
    units = engine._fast.fused
    before = [[t.clone() for t in u.tensors()] for u in units]
    norm = engine.model.model.norm.weight.clone()
    engine.load_weights(Qwen3ForCausalLM.from_pretrained(old).named_parameters())  # the same weights
    for u, saved in zip(units, before):
        assert all(torch.equal(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
                               s.view(torch.uint8) if s.dtype == torch.float8_e4m3fn else s)
                   for t, s in zip(u.tensors(), saved))
    assert torch.equal(engine.model.model.norm.weight, norm)
    # new weights, the fused q/k/v rows sent one name at a time: what an engine built from them generates
    engine.load_weights(Qwen3ForCausalLM.from_pretrained(new).named_parameters())
    got, want = generate(engine), generate(engine_of(new))
    assert torch.equal(got.response_ids, want.response_ids)
    assert torch.equal(got.logprobs, want.logprobs)
    with pytest.raises(ValueError, match="expects"):
        engine.load_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, 64))])


def test_a_level_2_sleep_and_a_load_give_the_same_generation(tmp_path: Path) -> None:
    folder = folder_of(tmp_path)
    engine = engine_of(folder)
    first = generate(engine)
    engine.sleep(2)  # the CPU drops the weights, FP8 tensors included
    assert engine.needs_weights
    engine.load_weights(Qwen3ForCausalLM.from_pretrained(folder).named_parameters())
    engine.wake_up()
    again = generate(engine)
    assert torch.equal(first.response_ids, again.response_ids) and torch.equal(first.logprobs, again.logprobs)


def test_widths_the_scaled_gemm_cannot_take_are_refused(tmp_path: Path) -> None:
    folder = folder_of(tmp_path, 2, hidden_size=40, intermediate_size=72, num_attention_heads=4, head_dim=10)
    with pytest.raises(ValueError, match="multiples of 16"):
        engine_of(folder)


def test_plan_refuses_warns_and_counts_fp8() -> None:
    from spmd_rl.config import Config
    from spmd_rl.models.shape import ModelShape
    from spmd_rl.plan import plan

    shape = ModelShape("a 1.7B-like model", heads=16, kv_heads=8, layers=28, hidden=2048, head_dim=128,
                       intermediate=6144, vocab=151936, tied=True)
    cfg = Config()
    cfg.rollout.dtype, cfg.rollout.backend, cfg.rollout.top_p = "fp8", "vllm", 1.0
    with pytest.raises(ValueError, match="rollout.backend=vllm does not hold its weights in FP8"):
        plan(cfg, 2)
    cfg = Config()
    cfg.rollout.dtype = "fp8"
    assert any("rollout.dtype=fp8" in w and "--algo.rollout-is token" in w for w in plan(cfg, 2).warnings)
    cfg.algo.rollout_is = "token"
    assert not any("rollout.dtype=fp8" in w for w in plan(cfg, 2).warnings)

    def rollout_weights(dtype: str) -> int:
        c = Config()
        c.rollout.dtype = dtype
        parts = plan(c, 1, model_shape=shape).memory.ranks[0].parts
        return next(p.bytes for p in parts if p.name == "rollout weights")

    projections = 28 * (2 * 2048 * 2048 + 2 * 2048 * 1024 + 3 * 2048 * 6144)
    assert rollout_weights("auto") - rollout_weights("fp8") == projections - 4 * 28 * (2048 + 2 * 1024 + 2048 + 2 * 6144
                                                                                        + 2048)


def test_a_run_logs_the_gap_fp8_makes(tmp_path: Path) -> None:
    """The same two steps in the model dtype and in FP8 (tiny-random's widths are multiples of 16): the FP8
    rollout's log-probs are further from the trainer's, and the rollout correction reports it."""
    from test_train_e2e import _check, launch, read_metrics

    gaps = {}
    for dtype in ("auto", "fp8"):
        out = str(tmp_path / dtype)
        _check(launch(out, "--rollout.dtype", dtype, "--algo.rollout-is", "token", "--trainer.total-steps", "2",
                      nproc=1))
        steps = [m for m in read_metrics(out) if "rollout_corr/kl" in m]
        assert [m["step"] for m in steps] == [1, 2]
        gaps[dtype] = steps[0]["rollout/logprob_abs_diff"]
    assert gaps["fp8"] > 20 * gaps["auto"], gaps


@cuda
def test_the_captured_fp8_step_equals_the_eager_one(tmp_path: Path) -> None:
    """bf16 on Hopper: the CUDA graph of the FP8 step generates what the same step run eagerly does, and
    its log-probs stay near the bf16 rollout's."""
    folder = folder_of(tmp_path)
    outs = []
    for graphs in (True, False):
        engine = engine_of(folder, device="cuda", dtype=torch.bfloat16)
        assert engine._fast.use_graphs
        engine._fast.use_graphs = graphs
        outs.append(generate(engine, temperature=0.0))
    assert torch.equal(outs[0].response_ids, outs[1].response_ids)
    assert torch.allclose(outs[0].logprobs, outs[1].logprobs, atol=1e-2)
    plain = generate(engine_of(folder, fp8=False, device="cuda", dtype=torch.bfloat16), temperature=0.0)
    mask = plain.response_mask.bool() & outs[0].response_mask.bool()
    same = (plain.response_ids == outs[0].response_ids)[mask].float().mean()
    assert same > 0.5, f"only {same:.0%} of greedy tokens agree with the bf16 rollout"


def test_the_benchmark_runs_on_the_cpu(tmp_path: Path, capsys) -> None:
    """``bench/fp8_rollout.py``'s CPU command, smaller: a speed row per weight format (FP8 reading fewer
    bytes) and a gap row per format (FP8's larger)."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import fp8_rollout

    out = tmp_path / "rows.jsonl"
    fp8_rollout.main(["--speed-shapes", "tiny", "--batches", "4", "--prompt-len", "8", "--new-tokens", "8",
                      "--gap-model", "tiny", "--gap-prompts", "2", "--gap-n", "2", "--gap-new-tokens", "6",
                      "--root", str(tmp_path / "models"), "--out", str(out), "--device", "cpu"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    speed, gap = [r for r in rows if r["kind"] == "speed"], [r for r in rows if r["kind"] == "gap"]
    assert [r["weights"] for r in speed] == ["float32", "fp8"] and speed[1]["fp8_gemms"] == speed[1]["gemms"]
    assert speed[1]["weight_gb"] < speed[0]["weight_gb"]
    assert [r["tokens"] for r in gap] == [2 * 2 * 6] * 2
    assert gap[1]["logprob_abs_diff_mean"] > 10 * gap[0]["logprob_abs_diff_mean"]
    assert "rollout_corr/kl" in capsys.readouterr().out
