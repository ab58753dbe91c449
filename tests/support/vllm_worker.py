"""Measurements of the vLLM rollout engine, run with the Python that has vLLM (tests/test_vllm_rollout.py).

    TPS=2,1 PP=1 torchrun --nproc-per-node 2 tests/support/vllm_worker.py OUT_DIR

It only measures and writes ``OUT_DIR/tp<TP>-rank<R>.json`` for each TP of ``$TPS``, one engine after
the other in the same processes (one launch, one vLLM import); the pytest side asserts. Model: the
``tiny-random`` Llama (4 layers, hidden 256, head_dim 64, which vLLM's CPU attention supports), in
float32, so vLLM and the FSDP engine can be compared tightly; for ``tp = 1`` (a replica per rank)
with its ``lm_head`` tied to the embedding, as SmolLM2 has it, and with the checks one replica can
make alone: greedy answers against transformers' ``generate``, EOS ids, and resident memory over
sleep / hot-swap / wake cycles. The "trainer" log-probs come from
:class:`spmd_rl.engine.fsdp.FSDPEngine`, the engine the trainer uses, on the same world.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from spmd_rl.config import FsdpConfig  # noqa: E402
from spmd_rl.data.batch import RolloutBatch  # noqa: E402
from spmd_rl.distributed.dims import FsdpLayout, RolloutLayout  # noqa: E402
from spmd_rl.engine.fsdp import FSDPEngine  # noqa: E402
from spmd_rl.models import load_causal_lm, load_tokenizer  # noqa: E402
from spmd_rl.models.builtin import TinyShape, cache_root, materialise_tiny_random  # noqa: E402

TINY = dict(layers=4, hidden=256, heads=4, kv_heads=2, seed=0)
MESSAGES = ["What is 2+3?", "Hi", "Please add 17 and 25, then explain the result in words.", "7*8?"]
T = 0.7
MAX_NEW = 24


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def perturbed_folder(base: str, out_dir: Path) -> str:
    """A copy of the model with every weight moved by N(0, 0.02 * std) noise (rank 0 writes it)."""
    target = out_dir / f"perturbed-{Path(base).name}"
    if dist.get_rank() == 0 and not (target / "config.json").is_file():
        model = load_causal_lm(base, dtype=torch.float32)
        g = torch.Generator().manual_seed(123)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.25 * p.float().std().clamp(min=1e-3))
        model.save_pretrained(str(target))
        load_tokenizer(base).save_pretrained(str(target))
    dist.barrier()
    return str(target)


def tied_folder(base: str, out_dir: Path) -> str:
    """The same model with ``lm_head`` tied to the embedding, as SmolLM2 has it (rank 0 writes it)."""
    target = out_dir / "tied"
    if dist.get_rank() == 0 and not (target / "config.json").is_file():
        model = load_causal_lm(base, dtype=torch.float32)
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
        model.save_pretrained(str(target))
        load_tokenizer(base).save_pretrained(str(target))
    dist.barrier()
    return str(target)


def logprob_diff(engine: FSDPEngine, gen) -> dict[str, float]:
    batch = RolloutBatch(prompts=gen.prompt_ids,
                         tensors={"response_ids": gen.response_ids, "response_mask": gen.response_mask})
    trainer_lp, _ = engine.compute_logprobs(batch, temperature=T, micro_batch_size=4)
    mask = gen.response_mask
    diff = (trainer_lp.cpu() - gen.logprobs).abs() * mask
    return dict(mean=(diff.sum() / mask.sum()).item(), max=diff.max().item(), tokens=mask.sum().item())


def rows(gen) -> list[list[int]]:
    return [r[m.bool()].tolist() for r, m in zip(gen.response_ids, gen.response_mask)]


def init_world(again: int = 0) -> None:
    """The world of this process: torchrun's, else one rank. ``again``: vLLM's engine shutdown
    destroyed it, a new one over a fresh file store (torchrun's store holds the old world's keys)."""
    if "RANK" in os.environ and not again:
        dist.init_process_group("gloo")
    else:  # one process, or a new world: over a local file store
        store = dist.FileStore(str(Path(os.environ["OUT_DIR"]) / f"store{again}"), int(os.environ.get("WORLD_SIZE", "1")))
        dist.init_process_group("gloo", store=store, rank=int(os.environ.get("RANK", "0")),
                                world_size=int(os.environ.get("WORLD_SIZE", "1")))


def main(out_dir: Path) -> None:
    os.environ["OUT_DIR"] = str(out_dir)
    # the trainer's modules, imported where vLLM is installed, must not import it
    import spmd_rl.rollout  # noqa: F401
    import spmd_rl.train  # noqa: F401
    import spmd_rl.trainer  # noqa: F401

    core_imported_vllm = "vllm" in sys.modules
    init_world()
    pp = int(os.environ.get("PP", "1"))
    for i, tp in enumerate(int(t) for t in os.environ.get("TPS", "1").split(",")):
        if not dist.is_initialized():  # the previous engine's shutdown destroyed the world
            init_world(again=i)
        result = measure(out_dir, tp, pp)
        result["core_imported_vllm"] = core_imported_vllm
        (out_dir / f"tp{tp}-rank{result['rank']}.json").write_text(json.dumps(result))
    if dist.is_initialized():  # vLLM's engine shutdown may have torn the world down already
        dist.destroy_process_group()


def measure(out_dir: Path, tp: int, pp: int) -> dict:
    """One vLLM engine of ``tp`` x ``pp`` on this world: what :func:`main` writes for it (with
    ``tp = 1``, a replica per rank: the tied model and the one-replica checks)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    from spmd_rl.rollout import build_rollout

    folder = str(materialise_tiny_random(cache_root(None), TinyShape(**TINY)))
    replica_checks = tp == 1
    if replica_checks:  # tied embeddings: the hot-swap must reach vLLM's processed lm_head too
        folder = tied_folder(folder, out_dir)
    tok = load_tokenizer(folder)
    prompts = [tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                       tokenize=True)["input_ids"] for m in MESSAGES]
    layout = RolloutLayout(world, tp=tp, pp=pp)
    replica = layout.coords(rank)["dp"]
    result: dict = dict(rank=rank, world=world, tp=tp, pp=pp, replica=replica, layout_tp=layout.groups()["tp"],
                        layout_pp=layout.groups()["pp"])
    t0 = time.perf_counter()
    engine = build_rollout("vllm", model_folder=folder, device=torch.device("cpu"), dtype=torch.float32,
                           batch_size=16, pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id],
                           tp=tp, pp=pp, max_model_len=256, seed=replica)
    result["start_s"] = time.perf_counter() - t0
    from vllm.distributed import parallel_state as ps

    result["tied"] = engine.llm.apply_model(lambda m: m.lm_head.weight is m.model.embed_tokens.weight)[0]
    result["vllm_tp"] = ps.get_tp_group().ranks
    result["vllm_pp"] = ps.get_pp_group().ranks
    mesh = FsdpLayout(world).build("cpu")
    base_fsdp = FSDPEngine(model_folder=folder, mesh=mesh, device=torch.device("cpu"), fsdp=FsdpConfig(),
                           trainable=False, pad_token_id=tok.pad_token_id)

    sample = dict(n=2, temperature=T, top_p=1.0, top_k=0, max_new_tokens=MAX_NEW)
    t0 = time.perf_counter()
    a = engine.generate(prompts, seed=100 + replica, **sample)
    result["gen_s"] = time.perf_counter() - t0
    result["a"] = rows(a)
    result["a_truncated"] = a.truncated.tolist()
    result["a_logprob_vs_fsdp"] = logprob_diff(base_fsdp, a)
    result["same_seed_equal"] = rows(engine.generate(prompts, seed=100 + replica, **sample)) == rows(a)
    result["other_seed_differs"] = rows(engine.generate(prompts, seed=200 + replica, **sample)) != rows(a)

    # Hot-swap, in the trainer's order: sleep, load the actor's streamed full tensors, wake, generate.
    perturbed = perturbed_folder(folder, out_dir)
    new_fsdp = FSDPEngine(model_folder=perturbed, mesh=mesh, device=torch.device("cpu"),
                          fsdp=FsdpConfig(), trainable=False, pad_token_id=tok.pad_token_id)
    engine.sleep(1)
    try:
        engine.generate(prompts, seed=1, **sample)
        result["asleep_refused"] = False
    except RuntimeError as e:
        result["asleep_refused"] = "asleep" in str(e)
    engine.load_weights(new_fsdp.named_full_tensors())
    engine.wake_up()
    b = engine.generate(prompts, seed=100 + replica, **sample)
    result["b"] = rows(b)
    result["b_logprob_vs_new_fsdp"] = logprob_diff(new_fsdp, b)
    result["b_logprob_vs_base_fsdp"] = logprob_diff(base_fsdp, b)

    if replica_checks:
        # Greedy answers against transformers' own generate, one prompt at a time (no padding).
        greedy = engine.generate(prompts, n=1, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=MAX_NEW, seed=0)
        model = load_causal_lm(perturbed, dtype=torch.float32)
        hf = []
        for p in prompts:
            ids = torch.tensor([p])
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            hf.append(ref[0, len(p):].tolist())
        result["greedy"] = rows(greedy)
        result["greedy_hf"] = hf
        # EOS: make a token the first response emits an EOS id; rows stop at its first occurrence.
        stop = result["b"][0][1]
        engine.eos_token_ids = [tok.eos_token_id, stop]
        c = engine.generate(prompts, seed=100, **sample)
        result["eos_id"] = stop
        result["eos_ids"] = engine.eos_token_ids
        result["c"] = rows(c)
        result["c_truncated"] = c.truncated.tolist()
        result["c_mask_rows"] = [m.tolist() for m in c.response_mask]
        engine.eos_token_ids = [tok.eos_token_id]
        # Sleep / wake / hot-swap / generate cycles: resident memory must level off.
        rss = []
        for cycle in range(12):
            engine.sleep(1 + cycle % 2)
            engine.load_weights((new_fsdp if cycle % 2 else base_fsdp).named_full_tensors())
            engine.wake_up()
            engine.generate(prompts, seed=cycle, **sample)
            rss.append(rss_mb())
        result["rss_mb"] = rss
        result["sleep_supported"] = engine.sleep_supported
    engine.close()
    return result


if __name__ == "__main__":
    main(Path(sys.argv[1]))
