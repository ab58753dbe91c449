"""spmd_rl: GRPO/PPO-family RL for LLMs as one SPMD program."""
