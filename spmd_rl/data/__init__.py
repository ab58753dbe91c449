"""Prompt data: built-in generated tasks, JSONL / Parquet files, chat-template rendering and the
resumable prompt sampler.

Typical start-up on rank 0::

    from spmd_rl.data import PromptSampler, build_prompts, columns_of, render_prompts
    train, val = build_prompts(cfg.data)
    train, train_ids, dropped = render_prompts(train, tokenizer, system_prompt=cfg.data.system_prompt,
                                               max_prompt_length=cfg.data.max_prompt_length)
    sampler = PromptSampler(len(train), cfg.data.train_batch_size, cfg.data.seed)
    batch = [train[i] for i in sampler.next_batch()]
    scorer(prompts, completions, columns_of(batch))
"""

from spmd_rl.data.files import build_prompts, read_located, read_records
from spmd_rl.data.prompts import render_prompts, sample_messages
from spmd_rl.data.sampler import PromptSampler
from spmd_rl.data.tasks import Sample, columns_of, generate_arithmetic, generate_countdown

__all__ = [
    "PromptSampler", "Sample", "build_prompts", "columns_of", "generate_arithmetic", "generate_countdown",
    "read_located", "read_records", "render_prompts", "sample_messages",
]
