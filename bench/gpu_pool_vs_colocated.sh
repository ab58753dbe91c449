#!/usr/bin/env bash
# Roles on their own pools on one GPU (pools.colocate 2): the weight transfer by CUDA IPC next to the
# colocated hot-swap (bench/pools.py), then the same GRPO run colocated (1 process) and with a rollout
# pool sharing the GPU (2 processes), with a table of their stage times. Run from the repository root.
#
# Usage: bash bench/gpu_pool_vs_colocated.sh [STEPS]       (default 8 steps; output: two tables, and $OUT/*)
# Environment: SHAPE (default qwen2-0.5b: random weights, bench/shapes.py), WHEELHOUSE (offline
# packages, see docs/PERF.md), OUT (default /tmp/gpu_pool_vs_colocated).
set -euo pipefail
STEPS=${1:-8}
SHAPE=${SHAPE:-qwen2-0.5b}
OUT=${OUT:-/tmp/gpu_pool_vs_colocated}
MODEL=$SHAPE
mkdir -p "$OUT"
. bench/offline_env.sh  # $WHEELHOUSE packages, PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

echo "== weight transfer, actor and rollout process on one GPU (CUDA IPC)"
torchrun --nproc-per-node 2 bench/pools.py --colocate 2 --out "$OUT/transfer.jsonl" 2>"$OUT/transfer.log" \
  || { tail -30 "$OUT/transfer.log"; exit 1; }

FOLDER=$(python3 -c "import sys; sys.path.insert(0, 'bench'); from shapes import model_folder, default_root; print(model_folder('$SHAPE', root=default_root()))")
FLAGS=(--model.path "$FOLDER" --data.train-batch-size 32 --rollout.n 8 --rollout.max-new-tokens 256
       --rollout.ignore-eos --actor.ppo-mini-batch-size 32 --actor.micro-batch-size 32 --trainer.total-steps "$STEPS"
       --trainer.val-every 0 --logging.wandb off --logging.no-console --checkpoint.no-save-final)
echo "== GRPO, $SHAPE (random weights), 32 prompts x 8, 256 new tokens, $STEPS steps"
torchrun --nproc-per-node 1 -m spmd_rl.train "${FLAGS[@]}" --trainer.output-dir "$OUT/colocated" \
  > "$OUT/colocated.log" 2>&1 || { tail -40 "$OUT/colocated.log"; exit 1; }
torchrun --nproc-per-node 2 -m spmd_rl.train "${FLAGS[@]}" --pools.rollout-ranks 1 --pools.colocate 2 \
  --trainer.output-dir "$OUT/pool" > "$OUT/pool.log" 2>&1 || { tail -40 "$OUT/pool.log"; exit 1; }
python3 - "$OUT" <<'PY'
import json, statistics, sys
out = sys.argv[1]
print(f"{'run':28s} {'step s':>7s} {'weight_sync s':>13s} {'gen s':>6s} {'update s':>8s}  (median of steps 3..)")
for name, label in (("colocated", "colocated, 1 process"), ("pool", "rollout pool, colocate 2")):
    rows = [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl")]
    rows = [r for r in rows if "timing_s/step" in r and r["step"] >= 3]
    med = lambda k: statistics.median(r[k] for r in rows)
    print(f"{label:28s} {med('timing_s/step'):7.3f} {med('timing_s/weight_sync'):13.3f} {med('timing_s/gen'):6.3f} "
          f"{med('timing_s/update'):8.3f}")
PY
