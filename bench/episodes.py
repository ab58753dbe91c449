"""Multi-turn episodes vs single-turn rows on the same engine, one process, one table.

    python bench/episodes.py                                             # GPU: SmolLM2's and Qwen3-1.7B's shapes, batch 256
    python bench/episodes.py --shapes tiny --batch 8 --episodes 16 --new-tokens 8 --env-tokens 8   # CPU smoke run

What it measures (random weights from transformers' config classes, bf16 on CUDA, fp32 on CPU; EOS
outside the vocabulary, so every turn is ``--new-tokens`` long; sampling at T = 1): ``--episodes``
episodes of ``--turns`` model turns on ``--batch`` slots of the native engine's stream
(:meth:`~spmd_rl.rollout.native.NativeRollout.stream`), as :class:`~spmd_rl.episodes.runner.EpisodeRunner`
plays them: each finished turn goes to a worker thread (``--workers``) that waits ``--tool-ms`` (a
tool) and answers ``--env-tokens`` tokens, then the episode is fed again with its whole prefix.

* ``multi-turn``: with prefix reuse (``keep_prefixes``: the next turn prefills only the new tokens);
* ``multi-turn, no reuse``: every turn prefilled whole;
* ``single-turn``: the same number of rows, one turn each of the same length, from the same prompts:
  the reference tok/s of the engine.

Columns: episodes/s, model tok/s (the model's sampled tokens / wall time), "of single" (model tok/s
over the single-turn row's), "tool wait" (the share of the wall time in which no row was live because
every episode waited for its tool), "reused" (prompt tokens not prefilled again). One warm-up pass of
each row first (compiles, captures the graphs). ``--out`` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import torch

SHAPES = {  # name -> (transformers config class name, its arguments)
    "tiny": ("LlamaConfig", dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)),
    "smollm2-135m": ("LlamaConfig", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                         tie_word_embeddings=True)),
    "qwen3-1.7b": ("Qwen3Config", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                       head_dim=128, tie_word_embeddings=True)),
}


def build_engine(shape: str, batch: int, device: torch.device, folder: str):
    """The native engine over random weights of ``shape``, saved to ``folder`` first."""
    import transformers

    from spmd_rl.rollout.native import NativeRollout

    cls, kwargs = SHAPES[shape]
    config = getattr(transformers, cls)(max_position_embeddings=8192, pad_token_id=0, **kwargs)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(folder)
    return NativeRollout(folder, device=device, dtype=dtype, batch_size=batch, pad_token_id=0,
                         eos_token_ids=[config.vocab_size])  # never sampled: every turn is full length


def play(engine, prompts: list[list[int]], *, turns: int, new_tokens: int, env_tokens: int, tool_s: float,
         workers: int, keep: bool, vocab: int) -> dict:
    """Every prompt as an episode of ``turns`` turns; the wall time, tokens and the time nothing was live."""
    ids = {k: list(p) for k, p in enumerate(prompts)}
    made = dict.fromkeys(ids, 0)
    fresh, ready, steps = list(ids), [], {}
    slots, under_way = (engine.batch_size if keep else None), [0]  # as EpisodeRunner admits episodes
    gen = torch.Generator().manual_seed(1)
    answer = torch.randint(3, vocab, (len(ids), turns, env_tokens), generator=gen).tolist()

    def tool(key: int, tokens: list[int]) -> int:
        time.sleep(tool_s)
        ids[key] += tokens + answer[key][made[key] // new_tokens - 1]
        return key

    def collect(futures) -> None:
        for f in futures:
            steps.pop(f)
            ready.append(f.result())

    def feed(k: int):
        collect([f for f in steps if f.done()])
        taken, ready[:] = ready[:k], ready[k:]
        room = k - len(taken) if slots is None else min(k - len(taken), slots - under_way[0])
        if room > 0 and fresh:
            new = fresh[:room]
            del fresh[:room]
            taken += new
            under_way[0] += len(new)
        return [(key, ids[key]) for key in taken]

    def done(key, tokens, logprobs, swaps, truncated) -> None:
        made[key] += len(tokens)
        if made[key] < turns * new_tokens:
            steps[pool.submit(tool, key, tokens.tolist())] = key
        else:
            engine.forget_prefixes(key)  # the episode ended: its slot is free for good
            under_way[0] -= 1

    engine.forget_prefixes()  # keys 0.. are this call's episodes (as EpisodeRunner.run does)
    longest = max(map(len, prompts)) + turns * (new_tokens + env_tokens)
    idle, calls, start = 0.0, 0, time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        while ready or steps or fresh:
            if not ready and not (fresh and (slots is None or under_way[0] < slots)):
                t = time.perf_counter()
                collect(list(wait(list(steps), return_when=FIRST_COMPLETED)[0]))
                idle += time.perf_counter() - t
                continue
            engine.stream(feed=feed, done=done, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new_tokens,
                          max_prompt_length=longest, seed=calls, keep_prefixes=keep)
            calls += 1
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return {"wall": time.perf_counter() - start, "tokens": sum(made.values()), "idle": idle}


def measure(args, shape: str, device: torch.device) -> list[dict]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="spmd_rl-bench-") as folder:
        engine = build_engine(shape, args.batch, device, folder)
    vocab = SHAPES[shape][1]["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.episodes)]
    common = dict(new_tokens=args.new_tokens, env_tokens=args.env_tokens, tool_s=args.tool_ms / 1000,
                  workers=args.workers, vocab=vocab)
    cases = [("multi-turn", dict(turns=args.turns, keep=True)), ("multi-turn, no reuse", dict(turns=args.turns, keep=False)),
             ("single-turn", dict(turns=1, keep=False))]
    rows = []
    for name, case in cases:
        batch = prompts * (args.turns if case["turns"] == 1 else 1)  # the same model tokens as the episodes
        play(engine, batch[:args.batch], **case, **common)  # warm-up
        reused = engine.reused_tokens
        got = play(engine, batch, **case, **common)
        rows.append({"shape": shape, "case": name, "episodes_s": args.episodes / got["wall"],
                     "tok_s": got["tokens"] / got["wall"], "tool_wait": got["idle"] / got["wall"],
                     "reused": engine.reused_tokens - reused})
    single = rows[-1]["tok_s"]
    for r in rows:
        r["of_single"] = r["tok_s"] / single
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["smollm2-135m", "qwen3-1.7b"], choices=sorted(SHAPES))
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--episodes", type=int, default=1024)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--env-tokens", type=int, default=32)
    p.add_argument("--tool-ms", type=float, default=20.0)
    p.add_argument("--workers", type=int, default=32)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from spmd_rl.distributed.env import use_host_threads

    use_host_threads(device)  # the host threads a rollout rank of spmd_rl.train runs with
    rows = []
    print("| shape | case | episodes/s | model tok/s | of single | tool wait | reused |\n|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        for r in measure(args, shape, device):
            rows.append(r)
            print(f"| {r['shape']} | {r['case']} | {r['episodes_s']:.2f} | {r['tok_s']:.0f} | {r['of_single']:.0%} | "
                  f"{r['tool_wait']:.0%} | {r['reused']} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
