#!/usr/bin/env bash
# Every GPU check of the project in one command, for the lent GPU machine (no registry there).
# Expects: wheels in .whl/ (../shared/tools/device_wheels.sh gguf==0.19.0) and the SmolLM2 GGUF,
# split by ../shared/tools/device_model_parts.sh, reassembled at /root/m/smol.gguf (or .model/).
# Usage: bash bench/gpu_check.sh [STEPS]      Output: a table of results at the end, and $OUT/*.
set -euo pipefail
STEPS=${1:-25}
NPROC=${NPROC:-1}   # processes = GPUs on this machine
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
source bench/device_env.sh   # carried wheels and the carried SmolLM2 GGUF
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== CUDA tests"
  python3 -m pytest -q -x tests/test_rollout.py 2>&1 | tail -5 | tee "$OUT/pytest.txt"
fi

echo "== GRPO, GPU preset, $NPROC process(es) (NCCL), SmolLM2 bf16, $STEPS steps"
start=$(date +%s)
torchrun --nproc-per-node "$NPROC" -m spmd_rl.train --config configs/gpu_2x.yaml --trainer.total-steps "$STEPS" \
  --trainer.val-every "$STEPS" --trainer.output-dir "$OUT/run" --logging.wandb off --logging.no-console \
  --checkpoint.no-save-final \
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
