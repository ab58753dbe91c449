"""MoE router replay (``--actor.router-replay``): the rollout records each generated token's experts and
the actor's forwards route those tokens to them.

Run with ``python3 -m pytest tests/test_router_replay.py -q``. A tiny random Qwen3-MoE (a dense first
layer, two MoE layers of 8 experts, top 2), fp32 on the CPU:

* the built-in rollout's records are the experts Hugging Face's own forward of the finished sequence
  picks for every generated token (and -1 past each row's end), also when rows queue for slots;
* with the experts the trainer would pick itself, replay changes no log-prob; with other experts
  (a forced disagreement) the routers return exactly the recorded ones for the generated tokens and
  their own for the prompt, in the padded and the packed layout alike (the grid's alignment);
* plan() refuses the combinations that cannot record or replay, by name;
* a short run with a rollout pool carries the records across pools and logs the mismatch metrics.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from spmd_rl.distributed.testing import run_distributed
from support.devices import cuda

CONFIG = dict(hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3,
              head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, max_position_embeddings=128,
              initializer_range=0.2, mlp_only_layers=[0])
TOP_K, MOE_LAYERS = 2, 2


def moe_folder(root: Path, *, tokenizer: bool = False, **shape) -> str:
    """A tiny random Qwen3-MoE saved under ``root`` (with the built-in character tokenizer: a model
    ``spmd_rl.train`` can run); ``shape`` overrides :data:`CONFIG`."""
    from spmd_rl.models.tokenizer import EOS, PAD, SPECIAL_TOKENS, build_char_tokenizer

    folder = root / ("tiny-moe" + "".join(f"-{k}{v}" for k, v in sorted(shape.items())))
    if (folder / "config.json").exists():
        return str(folder)
    tok = build_char_tokenizer(model_max_length=128)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=len(tok), pad_token_id=SPECIAL_TOKENS.index(PAD),
                                               eos_token_id=SPECIAL_TOKENS.index(EOS), **{**CONFIG, **shape}))
    model.save_pretrained(folder)
    if tokenizer:
        tok.save_pretrained(folder)
    return str(folder)


def own_experts(model: torch.nn.Module, ids: list[int]) -> list[torch.Tensor]:
    """Hugging Face's top-k experts per MoE layer for every position of ``ids``: ``[positions, k]`` each."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
    return [torch.topk(torch.softmax(lg.float(), -1), TOP_K, -1).indices.sort(-1).values for lg in out.router_logits]


@pytest.mark.parametrize("batch_size", [8, 3])  # 3: rows queue for the slots of finished ones
def test_the_rollout_records_the_experts_of_every_generated_token(tmp_path: Path, batch_size: int) -> None:
    from spmd_rl.rollout.native import NativeRollout

    folder = moe_folder(tmp_path)
    model = Qwen3MoeForCausalLM.from_pretrained(folder).eval()
    engine = NativeRollout(folder, device=torch.device("cpu"), dtype=torch.float32, batch_size=batch_size,
                           pad_token_id=0, eos_token_ids=[1], record_routes=True)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    g = engine.generate(prompts, n=2, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=9, seed=3)
    assert g.routed_experts.shape == (6, g.response_ids.shape[1], MOE_LAYERS, TOP_K)
    assert g.routed_experts.dtype == torch.int16
    for i in range(6):
        n, prompt = int(g.response_mask[i].sum()), g.prompt_ids[i]
        ids = prompt + g.response_ids[i, :n].tolist()
        for j, own in enumerate(own_experts(model, ids)):
            recorded = g.routed_experts[i, :n, j].long().sort(-1).values
            assert torch.equal(recorded, own[len(prompt):]), (i, j)
        assert (g.routed_experts[i, n:] == -1).all()


def test_without_the_flag_nothing_is_recorded(tmp_path: Path) -> None:
    from spmd_rl.rollout.native import NativeRollout

    engine = NativeRollout(moe_folder(tmp_path), device=torch.device("cpu"), dtype=torch.float32, batch_size=4,
                           pad_token_id=0, eos_token_ids=[1])
    g = engine.generate([[5, 6, 7]], n=2, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4, seed=0)
    assert g.routed_experts is None


@cuda
def test_records_made_inside_the_cuda_graph_equal_the_eager_step(tmp_path: Path) -> None:
    """bf16 on the GPU, greedy: the captured step records the same experts as the same step run eagerly,
    and they agree with Hugging Face's bf16 forward for nearly every token (kernels differ in the last bits)."""
    from spmd_rl.rollout.native import NativeRollout

    folder = moe_folder(tmp_path, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        moe_intermediate_size=32)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    outs = []
    for graphs in (True, False):
        engine = NativeRollout(folder, device=torch.device("cuda"), dtype=torch.bfloat16, batch_size=4,
                               pad_token_id=0, eos_token_ids=[1], record_routes=True)
        assert engine._fast.use_graphs, "the bf16 MoE decode step should be captured"
        engine._fast.use_graphs = graphs
        outs.append(engine.generate(prompts, n=2, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=12, seed=0))
    assert torch.equal(outs[0].response_ids, outs[1].response_ids)
    assert torch.equal(outs[0].routed_experts, outs[1].routed_experts)
    model = Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    g, same, total = outs[0], 0, 0
    for i in range(len(g.prompt_ids)):
        n, prompt = int(g.response_mask[i].sum()), g.prompt_ids[i]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + g.response_ids[i, :n].tolist()], device="cuda"),
                           output_router_logits=True).router_logits
        for j, lg in enumerate(logits):
            own = torch.topk(torch.softmax(lg.float(), -1), TOP_K, -1).indices.sort(-1).values[len(prompt):].cpu()
            rec = g.routed_experts[i, :n, j].long().sort(-1).values
            same += int((own == rec).all(-1).sum())
            total += n
    assert same / total > 0.9, f"{same} of {total} token-layers agree with HF's bf16 forward"


def _engine_body(rank: int, world_size: int, folder: str, routes: torch.Tensor, packed: bool) -> dict:
    from spmd_rl.config import ActorConfig, FsdpConfig
    from spmd_rl.data.batch import RolloutBatch
    from spmd_rl.distributed.dims import FsdpLayout
    from spmd_rl.engine.fsdp import FSDPEngine

    gen = torch.Generator().manual_seed(3)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    mask = torch.tensor([[1.0] * 4, [1.0] * 2 + [0.0] * 2, [1.0] * 3 + [0.0]])
    batch = RolloutBatch(prompts=prompts, tensors={"response_ids": torch.randint(3, 40, (3, 4), generator=gen),
                                                   "response_mask": mask})
    out: dict = {"ids": [p + r[:int(m.sum())] for p, r, m in zip(prompts, batch["response_ids"].tolist(), mask)]}
    for replay in (False, True):
        engine = FSDPEngine(model_folder=folder, mesh=FsdpLayout(1).build("cpu"), device=torch.device("cpu"),
                            fsdp=FsdpConfig(), actor=ActorConfig(grad_clip=0.0, router_replay=replay), trainable=True,
                            pad_token_id=0, use_packing=packed)
        if replay:  # what each router returned, in the grid's order
            seen: list[torch.Tensor] = []
            for router in engine.replay.routers:
                router.register_forward_hook(lambda mod, args, res: seen.append(res[2].detach().clone()))
            batch["routed_experts"] = routes
            out["seen"] = seen
        out[replay], _ = engine.compute_logprobs(batch, temperature=1.0, micro_batch_size=3)
        # an update forward and backward run with the routes too (the loss sees the same log-probs)
        stats = engine.train_mini_batch(engine.micro_batches(batch, micro_batch_size=3),
                                        lambda lp, ent, micro: (-(lp * micro["response_mask"]).sum(), {}),
                                        temperature=1.0, need_entropy_grad=False)
        out[f"grad_norm_{replay}"] = stats["grad_norm"]
    return out


def _routes_for(model: torch.nn.Module, ids: list[list[int]], prompts: list[int], *, forced: bool) -> torch.Tensor:
    """``[3, 4, layers, k]``: HF's own experts of each response token, or (``forced``) the experts it ranks last."""
    routes = torch.full((3, 4, MOE_LAYERS, TOP_K), -1, dtype=torch.int16)
    for i, seq in enumerate(ids):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq]), output_router_logits=True).router_logits
        for j, lg in enumerate(logits):
            order = torch.softmax(lg.float(), -1).argsort(-1, descending=not forced)[:, :TOP_K]
            routes[i, :len(seq) - prompts[i], j] = order[prompts[i]:].to(torch.int16)
    return routes


@pytest.mark.parametrize("packed", [False, True])
def test_replay_routes_generated_tokens_to_the_recorded_experts(tmp_path: Path, packed: bool) -> None:
    folder = moe_folder(tmp_path)
    model = Qwen3MoeForCausalLM.from_pretrained(folder).eval()
    plens = [3, 5, 2]
    probe = run_distributed(_engine_body, 1, folder, torch.full((3, 4, MOE_LAYERS, TOP_K), -1, dtype=torch.int16),
                            packed)[0]
    ids = probe["ids"]
    # every token by its own logits (-1 everywhere): nothing changes
    assert torch.equal(probe[False], probe[True])
    # the experts the trainer picks itself, recorded: the same log-probs and gradient
    same = run_distributed(_engine_body, 1, folder, _routes_for(model, ids, plens, forced=False), packed)[0]
    assert torch.allclose(same[True], same[False], atol=1e-6)
    assert same["grad_norm_True"] == pytest.approx(same["grad_norm_False"], rel=1e-5)
    # a forced disagreement: the routers return the recorded experts for generated tokens, their own elsewhere
    routes = _routes_for(model, ids, plens, forced=True)
    forced = run_distributed(_engine_body, 1, folder, routes, packed)[0]
    assert (forced[True] - forced[False]).abs().max() > 1e-3
    first_forward = forced["seen"][:MOE_LAYERS]  # compute_logprobs' forward, one per MoE layer
    for j, got in enumerate(first_forward):
        cells = _token_cells(ids, plens, packed)
        for i, seq in enumerate(ids):
            own = own_experts(model, seq)[j]
            for pos in range(len(seq)):
                chosen = got[cells[(i, pos)]].sort().values
                want = (routes[i, pos - plens[i], j].long().sort().values if pos >= plens[i] else own[pos])
                assert torch.equal(chosen, want), (i, pos, j)


def _token_cells(ids: list[list[int]], plens: list[int], packed: bool) -> dict[tuple[int, int], int]:
    """Each (sequence, position)'s flat index in the engine's grid (engine/packing.py's layouts)."""
    from spmd_rl.data.batch import RolloutBatch
    from spmd_rl.engine.packing import flatten

    t = max(len(s) - p for s, p in zip(ids, plens))
    resp = torch.zeros(len(ids), t, dtype=torch.long)
    mask = torch.zeros(len(ids), t)
    for i, (s, p) in enumerate(zip(ids, plens)):
        resp[i, :len(s) - p] = torch.tensor(s[p:])
        mask[i, :len(s) - p] = 1
    micro = RolloutBatch(prompts=[s[:p] for s, p in zip(ids, plens)], tensors={"response_ids": resp, "response_mask": mask})
    flat = flatten(micro, pad_token_id=0, packed=packed)
    cells = {}
    width = flat.input_ids.shape[1]
    for i, (s, p) in enumerate(zip(ids, plens)):
        r, c = int(flat.target_rows[i, 0]), int(flat.target_cols[i, 0]) + 1  # the first response token's cell
        for pos in range(len(s)):
            cells[(i, pos)] = r * width + c - p + pos
    return cells


def test_plan_refuses_what_cannot_record_or_replay() -> None:
    from spmd_rl.config import Config
    from spmd_rl.models.shape import ModelShape
    from spmd_rl.plan import plan

    moe = ModelShape("a model", heads=4, kv_heads=2, layers=2, experts=8)
    dense = ModelShape("a dense model", heads=4, kv_heads=2, layers=2)

    def refused(shape: ModelShape, **sections) -> str:
        cfg = Config()
        cfg.actor.router_replay = True
        for path, value in sections.items():
            section, name = path.split("__")
            setattr(getattr(cfg, section), name, value)
        with pytest.raises(ValueError) as e:
            plan(cfg, 2, model_shape=shape)
        return str(e.value)

    assert "has no experts: drop --actor.router-replay" in refused(dense)
    assert "rollout.backend=vllm does not report which experts" in refused(moe, rollout__backend="vllm",
                                                                            rollout__top_p=1.0)
    assert "rollout.stream=True streams rows" in refused(moe, rollout__stream=True, pools__rollout_ranks=1,
                                                         trainer__max_staleness=1)
    assert "multi-turn episodes" in refused(moe, env__name="guess_number")
    cfg = Config()
    cfg.actor.router_replay = True
    plan(cfg, 2, model_shape=moe)  # the single-turn road with the built-in rollout and FSDP


def test_a_run_with_a_rollout_pool_replays_the_recorded_experts(tmp_path: Path) -> None:
    """Colocated, with a rollout pool, and one step ahead: the records cross pools and wait in the queue;
    the run logs the mismatch and their size."""
    from test_train_e2e import _check, launch, read_metrics

    folder = moe_folder(tmp_path, tokenizer=True)
    flags = ["--model.path", folder, "--actor.router-replay", "--trainer.total-steps", "2", "--rollout.max-new-tokens", "6",
             "--algo.rollout-is", "token"]
    colocated, pooled, ahead = str(tmp_path / "colocated"), str(tmp_path / "pool"), str(tmp_path / "ahead")
    _check(launch(colocated, *flags, nproc=1))
    _check(launch(pooled, *flags, "--pools.rollout-ranks", "1", nproc=2))
    # asynchronous: rounds generated one step ahead wait in the queue with their records
    _check(launch(ahead, *flags, "--pools.rollout-ranks", "1", "--trainer.max-staleness", "1", nproc=2))
    for out in (colocated, pooled, ahead):
        steps = [m for m in read_metrics(out) if "rollout_corr/kl" in m]
        assert [m["step"] for m in steps] == [1, 2]
        assert all(m["perf/router_replay_mb"] > 0 for m in steps)
    # the same seeds, the same tokens and experts: the pool's first step equals the colocated one's
    a, b = (read_metrics(o)[0] for o in (colocated, pooled))
    assert a["rollout_corr/kl"] == pytest.approx(b["rollout_corr/kl"], abs=1e-6)
    assert os.path.exists(os.path.join(pooled, "metrics.jsonl"))


def test_the_benchmark_runs_on_the_cpu(tmp_path: Path, capsys) -> None:
    """``bench/router_replay.py``'s CPU command, smaller: a row per way, replay lowering the largest gap."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import router_replay

    out = tmp_path / "rows.jsonl"
    router_replay.main(["--root", str(tmp_path / "models"), "--prompts", "4", "--max-new-tokens", "16",
                        "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["replay"] for r in rows] == [False, True]
    off, on = rows
    assert off["tokens"] == on["tokens"] == 4 * 2 * 16
    assert on["logprob_abs_diff_max"] <= off["logprob_abs_diff_max"]
    assert "experts differ" in capsys.readouterr().out


def test_records_that_do_not_fit_the_model_are_refused(tmp_path: Path) -> None:
    from spmd_rl.engine.routing import RouterReplay

    replay = RouterReplay(Qwen3MoeForCausalLM.from_pretrained(moe_folder(tmp_path)))
    replay.check(torch.full((2, 3, MOE_LAYERS, TOP_K), -1, dtype=torch.int16))
    with pytest.raises(ValueError, match=r"records of shape \(2, 3, 3, 2\) for a model of 2 MoE layers and top_k 2"):
        replay.check(torch.zeros(2, 3, 3, TOP_K, dtype=torch.int16))
    with pytest.raises(ValueError, match="expert 8 recorded, the model has 8"):
        replay.check(torch.full((2, 3, MOE_LAYERS, TOP_K), 8, dtype=torch.int16))
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        from transformers import LlamaConfig, LlamaForCausalLM

        RouterReplay(LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                                  num_attention_heads=4, vocab_size=50)))
