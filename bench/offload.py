"""GPU check of `actor.fsdp.param_offload`, `actor.fsdp.optimizer_offload` and `ref.param_offload`.

    python bench/offload.py                       # one GPU; tiny-random 8 x 512 by default
    python bench/offload.py --model smollm2-135m-instruct

One process. For each setting (none, params, params + optimizer) a fresh actor engine runs the
same two updates the trainer's way (``train_mini_batch`` per mini-batch, ``offload()`` after the
update, an old-log-prob forward and a weight stream in between) and reports the GPU memory the
engine holds between phases (allocated GiB above what was held before it was built), whether the optimizer still points at the model's parameters after
the round trips, and the largest weight difference against the no-offload run (offload only moves
bytes, so it should be ~0; bf16 kernels may differ in the last bit). A frozen reference engine
with ``param_offload`` shows its memory between forwards. On CPU every offload is a no-op.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from packing import make_batch  # noqa: E402
from shapes import resolve_bench_model  # noqa: E402

from spmd_rl.algo.objective import actor_objective  # noqa: E402
from spmd_rl.config import ActorConfig, AlgoConfig, FsdpConfig  # noqa: E402
from spmd_rl.distributed.dims import FsdpLayout  # noqa: E402
from spmd_rl.distributed.env import DistEnv  # noqa: E402
from spmd_rl.engine.fsdp import FSDPEngine  # noqa: E402


def gib(dev: torch.device) -> float:
    if dev.type != "cuda":
        return 0.0
    torch.cuda.synchronize(dev)
    return torch.cuda.memory_allocated(dev) / 2 ** 30


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--tiny", type=int, nargs=4, default=[8, 512, 8, 4])
    args = p.parse_args()
    env = DistEnv.from_environ().init()
    dev = env.device
    folder = resolve_bench_model(args.model, args.tiny)
    from transformers import AutoConfig

    batch = make_batch(argparse.Namespace(rows=32, n=4, prompt_len=[16, 64], max_response=128, seed=0),
                       vocab=AutoConfig.from_pretrained(folder).vocab_size)
    algo = AlgoConfig(use_kl_loss=True, kl_coef=0.01)
    tokens, seqs = batch["response_mask"].sum().item(), float(len(batch))

    def loss_fn(logprobs, entropy, micro):
        return actor_objective(logprobs, entropy, old_logprobs=micro["old_logprobs"].to(dev),
                               advantages=micro["advantages"].to(dev), response_mask=micro["response_mask"].to(dev),
                               ref_logprobs=micro["ref_logprobs"].to(dev), algo=algo, global_tokens=tokens, global_seqs=seqs)

    results = {}
    base = gib(dev)
    for name, params, optim in (("none", False, False), ("params", True, False), ("params+optimizer", True, True)):
        engine = FSDPEngine(model_folder=folder, mesh=FsdpLayout(1).build(dev.type), device=dev,
                            fsdp=FsdpConfig(param_offload=params, optimizer_offload=optim),
                            actor=ActorConfig(lr=1e-4), total_updates=10, trainable=True, pad_token_id=0)
        ids_before = [id(p) for p in engine.model.parameters()]
        after_init = gib(dev) - base
        between = []
        for _ in range(2):
            engine.compute_logprobs(batch, temperature=1.0, micro_batch_size=8)  # old log-probs
            for mini in batch.chunks(2):
                engine.train_mini_batch(engine.micro_batches(mini, micro_batch_size=8), loss_fn,
                                        temperature=1.0, need_entropy_grad=False)
            engine.offload()
            between.append(gib(dev) - base)
            sum(t.float().sum().item() for _, t in engine.named_full_tensors())  # hot-swap stream
        same_params = [id(p) for p in engine.model.parameters()] == ids_before == [
            id(p) for g in engine.optimizer.param_groups for p in g["params"]]
        weights = {n: t.detach().float().cpu().clone() for n, t in engine.named_full_tensors()}
        results[name] = weights
        diff = max((weights[n] - results["none"][n]).abs().max().item() for n in weights)
        print(f"{name:17s} after init {after_init:.3f} GiB, between phases {between[-1]:.3f} GiB, optimizer "
              f"params are the model's: {same_params}, max |w - w(no offload)| {diff:.2e}", flush=True)
        del engine
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    ref = FSDPEngine(model_folder=folder, mesh=FsdpLayout(1).build(dev.type), device=dev, fsdp=FsdpConfig(),
                     trainable=False, pad_token_id=0, param_offload=True)
    idle = gib(dev) - base
    lp, _ = ref.compute_logprobs(batch, temperature=1.0, micro_batch_size=8)
    print(f"reference, ref.param_offload: {idle:.3f} GiB before, {gib(dev) - base:.3f} GiB after a forward "
          f"(log-probs finite: {bool(torch.isfinite(lp).all())})")
    env.shutdown()


if __name__ == "__main__":
    main()
