"""Actor-update throughput and MFU of the FSDP engine, Qwen2-0.5B and -1.5B shapes, side by side.

    python bench/update.py                                    # one GPU: both shapes, bf16, three layouts
    python bench/update.py --gpus 1 2                         # 1 vs 2 GPUs (torchrun per count), one table
    torchrun --nproc-per-node 4 bench/update.py               # any number of GPUs, FSDP over all of them
    python bench/update.py --shapes tiny --rows 16 --prompt-len 8 24 --response-median 24 \
        --response-max 48 --max-tokens-per-gpu 512 --repeats 1 --device cpu       # CPU smoke run

Random weights from a config (``bench/shapes.py``), fp32 master weights computed in bf16 on GPU.
Each GPU holds ``--rows`` responses (weak scaling) with a realistic spread: prompts uniform in
``--prompt-len``, responses log-normal around ``--response-median`` clipped to
``[8, --response-max]``. One optimizer step (``FSDPEngine.train_mini_batch``, PPO clip + KL, as the
trainer runs it) is timed per repeat after ``--warmup`` untimed steps, for each layout of ONE engine:

* ``padded``        ``--micro-batch-size`` rows per micro-batch, left/right padding;
* ``packed+mask``   packed rows, token-budget micro-batches, SDPA with a dense block-diagonal mask
                    (the CPU path; on GPU the path before the flash varlen kernel);
* ``packed+flash``  packed rows through torch's flash varlen kernel (the GPU default);
* ``+compile``      (``--compile``) the last one with every decoder layer under ``torch.compile``;
* ``+plain``        on one GPU: the engine's plain module (``spmd_rl/engine/mixed.py``), not FSDP2
                    (``--wrap-one-rank`` wraps it).

Before timing, the packed log-probs of the flash kernel are compared with the dense-mask ones
on the same batch (GPU), and every row shows the first step's gradient norm (lr is 1e-6, so the
layouts see nearly the same weights: equal norms = equal gradients).

tokens/s counts real tokens (prompt + response) over all GPUs; MFU is the model FLOPs of the
update (3 forwards, :class:`spmd_rl.models.FlopsModel`, head on response positions only) over the
time and the bf16 peak of all GPUs. ``--out`` appends the rows as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import SHAPES, default_root, model_folder, random_grpo_batch  # noqa: E402

from spmd_rl.algo.objective import actor_objective  # noqa: E402
from spmd_rl.config import ActorConfig, AlgoConfig, FsdpConfig  # noqa: E402
from spmd_rl.data.batch import RolloutBatch  # noqa: E402
from spmd_rl.distributed.dims import FsdpLayout  # noqa: E402
from spmd_rl.distributed.env import DistEnv  # noqa: E402
from spmd_rl.engine import packing  # noqa: E402
from spmd_rl.engine.fsdp import FSDPEngine  # noqa: E402
from spmd_rl.metrics import peak_flops  # noqa: E402
from spmd_rl.models import FlopsModel  # noqa: E402


def make_batch(args: argparse.Namespace, vocab: int, seed: int) -> RolloutBatch:
    return random_grpo_batch(rows=args.rows, n=args.n, vocab=vocab, prompt_len=tuple(args.prompt_len),
                             response_median=args.response_median, response_min=8, response_max=args.response_max,
                             sigma=0.6, logprob=-12.0, seed=seed)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _global_sum(x: float, device: torch.device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return float(t.item())


def bench_shape(shape: str, args: argparse.Namespace, env: DistEnv) -> list[dict[str, object]]:
    folder = model_folder(shape, root=args.models)
    dev, world = env.device, env.world_size
    engines = ([] if args.compile_only else [("", False)]) + ([("+compile", True)] if args.compile or args.compile_only else [])
    # an MoE shape: one engine per experts implementation asked for (transformers' config._experts_implementation)
    experts = args.experts if SHAPES[shape].get("num_experts") else [None]
    engines = [(suffix + (f"+{e}" if e and len(experts) > 1 else ""), c, e) for suffix, c in engines for e in experts]
    rows_out: list[dict[str, object]] = []
    for suffix, compile_layers, experts_impl in engines:
        fsdp = FsdpConfig(reshard_after_forward=args.reshard_after_forward, compile_layers=compile_layers,
                          gather_once=args.gather_once, keep_logits_gib=args.keep_logits_gib,
                          wrap_one_rank=args.wrap_one_rank)
        engine = FSDPEngine(model_folder=folder, mesh=FsdpLayout(world).build(dev.type), device=dev, fsdp=fsdp,
                            actor=ActorConfig(lr=1e-6, grad_clip=1.0), total_updates=10 ** 6, trainable=True,
                            pad_token_id=0, use_packing=True, max_tokens_per_gpu=args.max_tokens_per_gpu)
        if experts_impl is not None:
            set_experts_implementation(engine.model, experts_impl)
        if args.eager_head:
            engine.fused_head = False
        if args.reduce_every_micro_batch:
            engine.reduce_every_micro_batch = True
        fm = FlopsModel.from_config(engine.config)
        batch = make_batch(args, int(engine.config.vocab_size), seed=args.seed + env.rank)
        prompt_lens = [len(p) for p in batch.prompts]
        resp_lens = batch["response_mask"].sum(1).long().tolist()
        flops = _global_sum(3 * fm.forward([p + r for p, r in zip(prompt_lens, resp_lens)], head_tokens=sum(resp_lens)), dev)
        real = _global_sum(float(sum(packing.row_tokens(batch))), dev)
        tokens, seqs = _global_sum(batch["response_mask"].sum().item(), dev), float(args.rows * world)
        algo = AlgoConfig(use_kl_loss=True, kl_coef=0.001, entropy_coef=0.0)

        def loss_fn(logprobs, entropy, micro):
            return actor_objective(logprobs, entropy, old_logprobs=micro["old_logprobs"].to(dev),
                                   advantages=micro["advantages"].to(dev), response_mask=micro["response_mask"].to(dev),
                                   ref_logprobs=micro["ref_logprobs"].to(dev), algo=algo,
                                   global_tokens=tokens, global_seqs=seqs)

        flash_ok = engine.flash_varlen
        layouts = [("padded+" + ("flash" if flash_ok else "mask"), False, flash_ok), ("packed+mask", True, False)]
        layouts += [("packed+flash", True, True)] if flash_ok else []
        if args.layouts:
            layouts = [l for l in layouts if l[0] in args.layouts]
        if compile_layers:
            layouts = layouts[-1:]
        elif flash_ok and not args.layouts:  # the flash kernel runs only here: check it against the dense mask on this batch
            engine.use_packing, engine.max_tokens_per_gpu = True, args.max_tokens_per_gpu
            got = {}
            try:
                for flash in (False, True):
                    engine.flash_varlen = flash
                    got[flash], _ = engine.compute_logprobs(batch, temperature=1.0, micro_batch_size=args.micro_batch_size)
            except Exception as e:  # report and time the other layouts
                layouts = [l for l in layouts if not l[2]]
                if env.is_main:
                    print(f"{shape}: flash varlen FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
            else:
                mask = batch["response_mask"].to(dev).bool()
                diff = (got[True] - got[False]).abs()[mask]
                if env.is_main:
                    print(f"{shape}: log-probs, packed flash vs dense mask: max |diff| {diff.max().item():.3e}, "
                          f"mean {diff.mean().item():.3e} (bf16), mean log-prob {got[False][mask].mean().item():.3f}",
                          flush=True)
        for name, packed, flash in layouts:
            engine.use_packing, engine.flash_varlen = packed, flash
            engine.max_tokens_per_gpu = args.max_tokens_per_gpu if packed else None
            micros = engine.micro_batches(batch, micro_batch_size=args.micro_batch_size)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(dev)
            seconds, norms = [], []
            try:
                for i in range(args.warmup + args.repeats):
                    _sync(dev)
                    start = time.perf_counter()
                    stats = engine.train_mini_batch(micros, loss_fn, temperature=1.0, need_entropy_grad=False)
                    norms.append(stats["grad_norm"])
                    _sync(dev)
                    if i >= args.warmup:  # warm-up steps: allocator, kernels, compilation
                        seconds.append(time.perf_counter() - start)
            except Exception as e:  # one layout failing (e.g. out of memory) must not hide the others
                if env.is_main:
                    print(f"{shape} {name}{suffix}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
                continue
            if args.profile and dev.type == "cuda":
                profile_step(engine, micros, loss_fn, show=env.is_main, label=f"{shape} {name}{suffix}",
                             top=args.profile_top, trace=args.profile_trace and env.is_main
                             and os.path.join(args.profile_trace, f"{shape}_{name}{suffix}.json.gz".replace("+", "_")))
            s = statistics.median(seconds)
            peak = peak_flops(dev)
            row: dict[str, object] = {
                "shape": shape, "layout": name + suffix + ("" if engine.sharded else "+plain"), "gpus": world, "rows_per_gpu": args.rows,
                "micro_batches": len(micros), "real_tokens": real, "seconds": s, "tokens_per_s": real / s,
                "tokens_per_s_per_gpu": real / s / world, "tflops_per_gpu": flops / s / world / 1e12,
                "mfu": flops / s / (peak * world) if peak else None, "grad_norm": norms[0],
            }
            if dev.type == "cuda":
                row["peak_mem_gib"] = torch.cuda.max_memory_allocated(dev) / 2 ** 30
            rows_out.append(row)
            if env.is_main:
                print(_fmt(row), flush=True)
        del engine
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows_out


def profile_step(engine: FSDPEngine, micros: list, loss_fn, *, show: bool, label: str, top: int,
                 trace: str | None = None) -> None:
    """One more step under torch.profiler: device time of the kernels by group (GEMM / attention /
    the rest), then the ``top`` torch ops and kernels that took longest, to see what an MFU short of
    the matmul peak is spent on; then one step under cProfile: the host's functions by their own time
    (every rank runs both steps; the main rank prints). ``trace``: the profiled step's Chrome trace,
    with Python stacks, to that path."""
    import cProfile
    import io
    import pstats

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from spmd_rl.profiling import format_idle_gaps, idle_gaps

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=bool(trace)) as prof:
        start = time.perf_counter()
        engine.train_mini_batch(micros, loss_fn, temperature=1.0, need_entropy_grad=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    if trace:
        os.makedirs(os.path.dirname(trace) or ".", exist_ok=True)
        prof.export_chrome_trace(trace)
    # the host's side: the Python functions of one more step by their own time (where the device waits
    # "(no torch range: Python)", the host is in one of these)
    host = cProfile.Profile()
    host.enable()
    engine.train_mini_batch(micros, loss_fn, temperature=1.0, need_entropy_grad=False)
    torch.cuda.synchronize()
    host.disable()
    if not show:
        return
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    ops = [e for e in events if e.device_type == DeviceType.CPU and e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in kernels) or 1.0
    # attention first: flash kernels' template names can contain GEMM words
    groups = {"attention": ("flash", "fmha", "attention"), "gemm": ("gemm", "cutlass", "xmma", "nvjet", "cublas")}
    share = {g: 0.0 for g in (*groups, "other")}
    for e in kernels:
        name = e.key.lower()
        share[next((g for g, keys in groups.items() if any(k in name for k in keys)), "other")] += e.self_device_time_total
    print(f"profile {label}: step {wall * 1e3:.1f} ms (profiled), kernels {total / 1e3:.1f} ms "
          f"(the GPU busy {100 * total / 1e6 / wall:.0f} % of it); " +
          ", ".join(f"{g} {100 * t / total:.1f} %" for g, t in share.items()), flush=True)
    print(format_idle_gaps(idle_gaps(prof, top=top)), flush=True)
    for title, events in (("torch ops", ops), ("kernels", kernels)):
        print(f"  top {top} {title} by device time:", flush=True)
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
            print(f"  {100 * e.self_device_time_total / total:5.1f} %  {e.self_device_time_total / 1e3:8.1f} ms  "
                  f"x{e.count:<5d} {e.key[:110]}", flush=True)
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(top)
    body = text.getvalue()
    print(f"  top {top} host functions by own time (cProfile, one step):", flush=True)
    print("\n".join("  " + line for line in body[body.find("ncalls"):].splitlines() if line.strip()), flush=True)


HEADER = (f"{'shape':11s} {'layout':22s} {'gpus':>4s} {'micro':>5s} {'tokens':>8s} {'s/step':>7s} {'tok/s':>9s} "
          f"{'tok/s/gpu':>9s} {'TFLOP/s/gpu':>11s} {'MFU':>6s} {'peak GiB':>8s} {'grad norm':>9s}")


def _fmt(r: dict[str, object]) -> str:
    mfu = f"{100 * r['mfu']:5.1f}%" if r.get("mfu") is not None else "   n/a"
    mem = f"{r['peak_mem_gib']:8.1f}" if "peak_mem_gib" in r else "       -"
    return (f"{r['shape']:11s} {r['layout']:22s} {r['gpus']:4d} {r['micro_batches']:5d} {r['real_tokens']:8.0f} "
            f"{r['seconds']:7.3f} {r['tokens_per_s']:9.0f} {r['tokens_per_s_per_gpu']:9.0f} "
            f"{r['tflops_per_gpu']:11.1f} {mfu} {mem} {r['grad_norm']:9.4g}")


def run_worker(args: argparse.Namespace) -> None:
    env = DistEnv.from_environ().init(device=args.device)
    if env.is_main:
        name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"
        print(f"update bench: {env.world_size} x {name}, torch {torch.__version__}, {args.rows} responses per GPU, "
              f"prompts {args.prompt_len[0]}-{args.prompt_len[1]}, responses ~{args.response_median} "
              f"(max {args.response_max}), {args.max_tokens_per_gpu} tokens per packed micro-batch", flush=True)
        print(HEADER, flush=True)
    rows = []
    for shape in args.shapes:
        try:
            rows += bench_shape(shape, args, env)
        except Exception as e:  # one shape failing (e.g. out of memory) must not hide the others
            if env.is_main:
                print(f"{shape}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
            if env.device.type == "cuda":
                torch.cuda.empty_cache()
    if env.is_main and args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    env.shutdown()


def run_gpu_counts(args: argparse.Namespace, argv: list[str]) -> None:
    """``--gpus 1 2``: one torchrun per count (same per-GPU work), then a table with the scaling."""
    available = torch.cuda.device_count() if args.device != "cpu" else os.cpu_count() or 1
    passthrough = [a for i, a in enumerate(argv) if not _is_gpus_arg(argv, i)]
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in args.gpus:
            if k > available:
                print(f"--gpus {k}: skipped, this machine has {available} device(s)", flush=True)
                continue
            out = os.path.join(tmp, f"gpus{k}.jsonl")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={k}",
                   str(Path(__file__).resolve()), *passthrough, "--out", out]
            print("$ " + " ".join(cmd), flush=True)
            subprocess.run(cmd, check=False)
            if os.path.exists(out):
                rows += [json.loads(line) for line in open(out)]
    print("\n" + HEADER)
    base = {(r["shape"], r["layout"]): r for r in rows if r["gpus"] == min(args.gpus)}
    for r in rows:
        b = base.get((r["shape"], r["layout"]))
        scale = f"  x{r['tokens_per_s'] / b['tokens_per_s']:.2f} vs {b['gpus']} GPU" if b and b is not r else ""
        print(_fmt(r) + scale)
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


def _is_gpus_arg(argv: list[str], i: int) -> bool:
    """True for ``--gpus`` and the counts after it."""
    if argv[i] == "--gpus" or argv[i].startswith("--gpus="):
        return True
    j = i - 1
    while j >= 0 and argv[j].isdigit():
        j -= 1
    return j >= 0 and argv[j] == "--gpus" and argv[i].isdigit()


def use_hf_norm_rope() -> None:
    """``--hf-norm-rope``: engines built after this keep Hugging Face's RMSNorm forward and rotate with
    HF's ``x * cos + rotate_half(x) * sin`` (five kernels forward, nine backward, per tensor)."""
    from spmd_rl.engine import attention, norms

    def hf_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    norms.install_norms = lambda model: 0
    attention.Rope.apply = staticmethod(hf_rope)


def set_experts_implementation(model: torch.nn.Module, name: str) -> None:
    """Every MoE experts module of ``model`` runs transformers' ``name`` implementation ("grouped_mm": the
    tokens sorted by expert once, two grouped GEMMs; "eager": a loop over the experts that got tokens)."""
    found = [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "config")]
    if not found:
        raise ValueError("--experts: the model has no transformers experts module")
    for m in found:
        m.config._experts_implementation = name


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["qwen2-0.5b", "qwen2-1.5b"], help="see bench/shapes.py")
    p.add_argument("--rows", type=int, default=128, help="responses per GPU")
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[64, 192], metavar=("MIN", "MAX"))
    p.add_argument("--response-median", type=int, default=320)
    p.add_argument("--response-max", type=int, default=1024)
    p.add_argument("--micro-batch-size", type=int, default=16, help="rows per padded micro-batch")
    p.add_argument("--max-tokens-per-gpu", type=int, default=24576, help="tokens per packed micro-batch")
    p.add_argument("--repeats", type=int, default=2, help="timed steps (their median is reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (a small model's first ~10 steps "
                   "in a process run slower)")
    p.add_argument("--experts", nargs="+", default=["grouped_mm"], choices=["grouped_mm", "eager", "batched_mm"],
                   help="MoE shapes: transformers' experts implementation(s), one engine each")
    p.add_argument("--compile", action="store_true", help="also time the last layout with compiled decoder layers")
    p.add_argument("--compile-only", action="store_true", help="only the compiled layers (skips the eager layouts)")
    p.add_argument("--layouts", nargs="+", default=None, help="only these layouts (e.g. packed+flash)")
    p.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                   help="FSDP2 reshard_after_forward (off: parameters stay gathered, and cast, until the backward)")
    p.add_argument("--wrap-one-rank", action="store_true",
                   help="FsdpConfig.wrap_one_rank: FSDP2 on one GPU too (default: the plain module, engine/mixed.py)")
    p.add_argument("--gather-once", action=argparse.BooleanOptionalAction, default=True,
                   help="FsdpConfig.gather_once (off: FSDP's per-layer gathers, also on one-rank shards)")
    p.add_argument("--keep-logits-gib", type=float, default=None,
                   help="FsdpConfig.keep_logits_gib (default: automatic, 1/16 of the GPU; 0: recompute the head's logits)")
    p.add_argument("--eager-head", action="store_true", help="the log-prob head's eager chunk code, not the compiled one")
    p.add_argument("--hf-norm-rope", action="store_true",
                   help="Hugging Face's RMSNorm and RoPE forwards, not the fused "
                   "ones (engine/norms.py, engine/attention.py's Rope)")
    p.add_argument("--reduce-every-micro-batch", action="store_true",
                   help="one GPU: reduce gradients after every micro-batch (the engine does it after the last only)")
    p.add_argument("--profile", action="store_true", help="GPU: one more step per layout under torch.profiler, "
                   "kernel time by group, the top torch ops and kernels")
    p.add_argument("--profile-top", type=int, default=15, help="how many ops and kernels --profile lists")
    p.add_argument("--profile-trace", default=None, metavar="DIR",
                   help="--profile: each profiled step's Chrome trace, with Python stacks, into DIR")
    p.add_argument("--gpus", type=int, nargs="+", default=None, help="run once per GPU count (torchrun) and compare")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--models", default=default_root(), help="where the random-weight model folders are built")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="append the rows as JSON lines to this file")
    args = p.parse_args(argv)
    if args.rows % args.n:
        raise SystemExit(f"--rows ({args.rows}) must be a multiple of --n ({args.n})")
    if args.hf_norm_rope:
        use_hf_norm_rope()
    if args.gpus and "RANK" not in os.environ:
        run_gpu_counts(args, argv)
    else:
        run_worker(args)


if __name__ == "__main__":
    main()
