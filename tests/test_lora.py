"""LoRA (``actor.lora``): only the adapters train, FSDP 2 ranks equal one process, the reference is the
frozen base, checkpoints hold the adapters and resume exactly, and the export merges them.

One 2-process world (gloo) builds, on every rank, a LoRA engine over both ranks and a one-rank LoRA
engine that takes the whole batch, makes two updates with each and compares (fp32, 1e-5) the merged
weights and the gradient norms; the two-rank engine's reference log-probs (adapters off) are compared
with the base model's in the parent; its state after the first update goes through a DCP save and
into a fresh engine, whose second update must equal the first engine's bit for bit. One torchrun run
learns the arithmetic task with LoRA and the KL term (reference = the frozen base) and its checkpoint
is exported both ways: merged (checked against base + scale * B @ A computed here) and as a PEFT
adapter folder (loaded by PEFT and merged by it).

Run: ``python -m pytest tests/test_lora.py -q``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from conftest import HERE, REPO
from spmd_rl.config import ActorConfig, FsdpConfig, LoraConfig, load_config
from spmd_rl.data.batch import RolloutBatch
from spmd_rl.distributed.dims import FsdpLayout
from spmd_rl.plan import plan
from spmd_rl.distributed.testing import cpu_env, run_distributed, run_program
from spmd_rl.engine.fsdp import FSDPEngine
from spmd_rl.engine.lora import FrozenBase, is_adapter_key
from spmd_rl.models import load_causal_lm, resolve_model_path
from support.numerics import max_rel, rel
from test_fsdp_parity import PAD, TEMPERATURE, make_batch, response_logprobs

LORA = LoraConfig(rank=4, alpha=8.0)
ACTOR = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01, grad_clip=0.5)
TOL = 1e-5


def _engine(folder: str, mesh: Any, seed: int) -> FSDPEngine:
    torch.manual_seed(seed)  # the adapters' initial A (B starts at zero)
    return FSDPEngine(model_folder=folder, mesh=mesh, device=torch.device("cpu"), fsdp=FsdpConfig(),
                      actor=ActorConfig(**ACTOR), total_updates=2, trainable=True, pad_token_id=PAD, lora=LORA)


def _update(engine: FSDPEngine, batch: RolloutBatch, group: Any) -> float:
    """One policy-gradient-like update on this rank's share of ``batch`` (counts summed over ``group``)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    share = len(batch) // size
    mine = batch.select(range(rank * share, (rank + 1) * share))
    tokens = torch.tensor([mine["response_mask"].sum().item()], dtype=torch.float64)
    dist.all_reduce(tokens, group=group)

    def loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor | None, micro: RolloutBatch):
        return -(logprobs * micro["advantages"]).sum() / tokens.item(), {}

    return engine.train_mini_batch(engine.micro_batches(mine, micro_batch_size=4), loss_fn, temperature=TEMPERATURE,
                                   need_entropy_grad=False)["grad_norm"]


def _body(rank: int, world_size: int, folder: str, batch: RolloutBatch, ckpt: str) -> dict[str, Any]:
    world = dist.new_group([0, 1])
    alone = [dist.new_group([r]) for r in range(world_size)][rank]
    out: dict[str, Any] = {}

    two = _engine(folder, FsdpLayout(2, -1).build("cpu"), seed=0)
    trainable = {n for n, p in two.model.named_parameters() if p.requires_grad}
    in_optimizer = {id(p) for g in two.optimizer.param_groups for p in g["params"]}
    out["trainable_are_adapters"] = bool(trainable) and all(is_adapter_key(n) for n in trainable)
    out["optimizer_is_adapters"] = in_optimizer == {id(p) for n, p in two.model.named_parameters() if n in trainable}
    # the reference forward first, as in a training step: the adapters must still train afterwards
    FrozenBase(two).compute_logprobs(batch.select(range(rank * 8, rank * 8 + 8)), temperature=TEMPERATURE,
                                     micro_batch_size=4)
    out["norms_two"] = [_update(two, batch, world)]
    dcp.save({"actor": two.state_dict()}, storage_writer=dcp.FileSystemWriter(ckpt), process_group=world)
    out["norms_two"].append(_update(two, batch, world))
    out["weights_two"] = {n: t.numpy().copy() for n, t in two.named_full_tensors()}
    share = len(batch) // 2
    mine = batch.select(range(rank * share, (rank + 1) * share))
    ref, _ = FrozenBase(two).compute_logprobs(mine, temperature=TEMPERATURE, micro_batch_size=4)
    actor, _ = two.compute_logprobs(mine, temperature=TEMPERATURE, micro_batch_size=4)
    out["ref_logprobs"], out["actor_logprobs"] = ref.numpy().copy(), actor.numpy().copy()

    # resume: a fresh engine (other adapters) loads the state after update 1, then makes update 2
    resumed = _engine(folder, FsdpLayout(2, -1).build("cpu"), seed=7)
    state = {"actor": resumed.state_dict()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(ckpt), process_group=world)
    resumed.load_state_dict(state["actor"])
    out["norm_resumed"] = _update(resumed, batch, world)
    out["weights_resumed"] = {n: t.numpy().copy() for n, t in resumed.named_full_tensors()}

    alone_meshes = [FsdpLayout(1, -1).build("cpu", start=r) for r in range(world_size)]  # collective: all build all
    one = _engine(folder, alone_meshes[rank], seed=0)  # the whole batch, alone
    out["norms_one"] = [_update(one, batch, alone) for _ in range(2)]
    out["weights_one"] = {n: t.numpy().copy() for n, t in one.named_full_tensors()}
    return out


@pytest.fixture(scope="module")
def folder() -> str:
    return resolve_model_path("tiny-random", cache_dir=None)


def test_lora_engine_parity_reference_and_resume(folder, tmp_path):
    batch = make_batch(folder)
    ckpt = str(tmp_path / "dcp")
    results = run_distributed(_body, 2, folder, batch, ckpt)
    base = load_causal_lm(folder, dtype=torch.float32)
    with torch.no_grad():
        base_logprobs, _ = response_logprobs(base, batch)
    base_logprobs = base_logprobs * batch["response_mask"]
    for rank, r in enumerate(results):
        assert r["trainable_are_adapters"] and r["optimizer_is_adapters"]
        # FSDP over 2 ranks == one process, both updates
        assert max(abs(a - b) / b for a, b in zip(r["norms_two"], r["norms_one"])) < TOL, (r["norms_two"], r["norms_one"])
        worst, name = max_rel(r["weights_two"], r["weights_one"])
        assert worst < TOL, f"rank {rank}: merged weights differ from one process by {worst:.2e} at {name}"
        assert sorted(r["weights_two"]) == sorted(n for n, _ in base.named_parameters())  # HF names, no PEFT infixes
        # the reference is the frozen base; the actor moved away from it
        own = base_logprobs[rank * 8:(rank + 1) * 8]
        assert rel(r["ref_logprobs"], own) < TOL, rel(r["ref_logprobs"], own)
        assert rel(r["actor_logprobs"], own) > 1e-3
        # resume from the state after update 1: update 2 is the same, bit for bit
        assert r["norm_resumed"] == r["norms_two"][1]
        for n, w in r["weights_resumed"].items():
            assert (w == r["weights_two"][n]).all(), f"rank {rank}: resumed weights differ at {n}"
    # the checkpoint holds the adapters and their AdamW state, no base weights
    saved = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("actor.model.")]
    assert model_keys and all(is_adapter_key(k) for k in model_keys), model_keys[:4]
    optim_keys = [k for k in saved if k.startswith("actor.optimizer.state.")]
    assert optim_keys and all(is_adapter_key(k) for k in optim_keys), optim_keys[:4]


def test_megatron_refuses_lora():
    cfg = load_config(["--actor.engine", "megatron", "--actor.lora.rank", "8"])
    with pytest.raises(ValueError, match=r"actor.lora.rank=8 trains LoRA adapters, which actor.engine=megatron does "
                                         r"not support: use --actor.engine fsdp"):
        plan(cfg, world_size=1)
    with pytest.raises(ValueError, match="actor.lora.rank must be >= 0"):
        load_config(["--actor.lora.rank", "-1"])


# ---------------------------------------------------------------------------------- end to end
TINY = [
    "--data.task", "arithmetic", "--data.train-batch-size", "8", "--data.val-size", "16",
    "--rollout.n", "8", "--rollout.max-new-tokens", "8", "--rollout.temperature", "1.0",
    "--actor.ppo-mini-batch-size", "8", "--actor.micro-batch-size", "16",
    "--reward.fn", "support.rewards:digit_fraction", "--logging.wandb", "off", "--logging.no-console",
    "--trainer.val-every", "0",
    "--actor.lora.rank", "8", "--actor.lora.alpha", "16", "--actor.lr", "2e-2",
    "--algo.use-kl-loss", "--algo.kl-coef", "0.001",
]


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = cpu_env(PYTHONPATH=os.pathsep.join([REPO, HERE]), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT\n{proc.stdout[-3000:]}\nSTDERR\n{proc.stderr[-6000:]}"
    return proc


def unit_scale_copy(folder: str, out: Path) -> str:
    """``tiny-random`` with its linear layers (the LM head, tied to the embeddings, included) rescaled to
    std 1/sqrt(fan-in), as in a trained model. The built-in weights (std 0.02) make a near-uniform policy whose hidden states are
    tiny, which adapters on the projections cannot move in a few steps (full fine-tuning learns by
    changing the head itself); with unit-scale activations LoRA learns the task in a few steps."""
    import shutil

    model = load_causal_lm(folder, dtype=torch.float32)
    model.config.tie_word_embeddings = True  # tied, as most small models are: checkpoints must not hold the head
    model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.mul_(1.0 / (module.weight.std() * module.weight.shape[1] ** 0.5))
    model.save_pretrained(out)
    for item in Path(folder).iterdir():
        if item.is_file() and item.name not in ("config.json", "model.safetensors"):
            shutil.copy2(item, out / item.name)
    return str(out)


def test_lora_learns_and_exports(folder, tmp_path):
    import json

    from peft import PeftModel
    from safetensors.torch import load_file

    from spmd_rl import export
    from spmd_rl.checkpoint_files import load_without_process_group

    folder = unit_scale_copy(folder, tmp_path / "model")
    out = tmp_path / "run"
    # the program, not its launcher, is under test: its rank forked from a warm process
    proc = run_program("spmd_rl.train", [*TINY, "--model.path", folder, "--trainer.output-dir", str(out),
                                         "--trainer.total-steps", "10"], nproc=1, cwd=REPO,
                       env={"PYTHONPATH": os.pathsep.join([REPO, HERE]), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT\n{proc.stdout[-3000:]}\nSTDERR\n{proc.stderr[-6000:]}"
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "critic/score/mean" in m]
    first = sum(m["critic/score/mean"] for m in steps[:2]) / 2
    last = sum(m["critic/score/mean"] for m in steps[-3:]) / 3
    assert last > first + 0.3, f"reward did not rise: first 2 steps {first:.3f}, last 3 steps {last:.3f}"
    assert steps[-1]["actor/kl_loss"] > 0  # the reference (the frozen base) differs from the trained policy

    ckpt = out / "checkpoints" / "step_10"
    adapters = load_without_process_group(ckpt, ["actor.model"])["actor"]["model"]
    assert adapters and all(is_adapter_key(k) for k in adapters), sorted(adapters)[:4]

    merged_dir, adapter_dir = tmp_path / "merged", tmp_path / "adapter"
    assert export.main([str(out), str(merged_dir)]) == 0  # the command itself runs in test_checkpoint.py
    assert export.main([str(out), str(adapter_dir), "--adapter"]) == 0
    merged = load_file(str(merged_dir / "model.safetensors"))
    expected = load_causal_lm(folder, dtype=torch.float32).state_dict()
    scale = 16 / 8
    for key, a in adapters.items():
        if ".lora_A." in key:
            module = key.split(".lora_A.")[0]
            b = adapters[key.replace(".lora_A.", ".lora_B.")]
            expected[f"{module}.weight"] = expected[f"{module}.weight"] + scale * b @ a
    assert set(merged) <= set(expected)
    for key, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[key], rtol=1e-6, atol=1e-6, msg=key)
    base = load_causal_lm(folder, dtype=torch.float32).state_dict()
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])

    assert {p.name for p in adapter_dir.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    by_peft = PeftModel.from_pretrained(load_causal_lm(folder, dtype=torch.float32), str(adapter_dir)).merge_and_unload()
    for key, tensor in by_peft.state_dict().items():
        if key in merged:
            torch.testing.assert_close(merged[key], tensor, rtol=1e-6, atol=1e-6, msg=key)
    assert Path(merged_dir / "config.json").is_file()


def test_memory_bench_tiny(tmp_path):
    """``bench/lora_memory.py --tiny`` runs on the CPU and prints one row per mode, LoRA training fewer parameters."""
    proc = _run("bench/lora_memory.py", "--tiny", "--root", str(tmp_path))
    rows = {line.split()[0] + (" " + line.split()[1] if line.startswith("LoRA") else ""): line.split()
            for line in proc.stdout.splitlines() if line.startswith(("full ", "LoRA r="))}
    assert set(rows) == {"full", "LoRA r=16"}, proc.stdout
    trainable = {mode: int(cols[2 if mode.startswith("LoRA") else 1].replace(",", "")) for mode, cols in rows.items()}
    assert 0 < trainable["LoRA r=16"] < trainable["full"], proc.stdout
