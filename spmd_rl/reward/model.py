"""Reward model: a sequence classifier (one output) under FSDP2 that scores token-id rows.

    inputs = RewardInputs.choose(input="auto", actor_tokenizer=tok, rm_tokenizer=rm_tok,
                                 system_prompt=None, max_length=1024)
    rows = inputs.rows(samples, prompt_ids, response_ids, completions)   # list[list[int]]
    rm = RewardModel(folder=folder, mesh=mesh, device=device, micro_batch_size=16)
    rm.check(rows)                                   # ValueError for ids outside its vocabulary
    scores = rm.score(rows, num_micro_batches=n)     # every rank of the mesh, the same n

What the model reads (``reward.model.input``): with the same tokenizer as the actor (``ids``) the
actor's prompt ids followed by the response ids as generated; otherwise (``text``) the sample's
chat plus an assistant turn holding the decoded completion, rendered with the reward model's own
chat template and tokenizer. Rows longer than ``reward.model.max_length`` keep their last tokens.

The score of a row is the head's output at its last token. Rows are left-padded, so the last
token is the last column for every row; a forward hook on the classification head (``score``,
the Hugging Face name for decoder classifiers) reads it there, so a response that ends with a
token equal to the pad id is still scored at its end.

:class:`ColocatedModelReward` runs the model on the global pool itself (FSDP over the actor's
mesh, offloaded between calls with ``reward.model.param_offload``); the reward pool runs it in
:class:`spmd_rl.reward.server.RewardServer`.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from spmd_rl.config import RewardModelConfig
from spmd_rl.data.prompts import has_chat_template, sample_messages
from spmd_rl.engine.sharding import shard_model
from spmd_rl.models import load_reward_model, resolve_model_path


def resolve_reward_model(rm: RewardModelConfig, *, cache_dir: str | None) -> str:
    """The local folder of ``reward.model.path`` (built-ins are materialised once, as for the actor)."""
    if rm.path is None:
        raise ValueError("reward.model.path is not set")
    try:
        return resolve_model_path(rm.path, cache_dir=cache_dir)
    except FileNotFoundError as e:
        raise FileNotFoundError(str(e).replace("--model.path", "--reward.model.path", 1)) from None


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two tokenizers map text to the same ids and render chats the same way."""
    return (
        a.get_vocab() == b.get_vocab()
        and list(a.all_special_tokens) == list(b.all_special_tokens)
        and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)
    )


class RewardInputs:
    """Builds the reward model's input ids for each response (see the module docstring)."""

    def __init__(self, *, mode: str, rm_tokenizer: Any, system_prompt: str | None, max_length: int) -> None:
        if mode not in ("ids", "text"):
            raise ValueError(f"reward.model.input must be ids or text here, got {mode!r}")
        self.mode = mode
        self.tokenizer = rm_tokenizer
        self.system_prompt = system_prompt
        self.max_length = max_length

    @classmethod
    def choose(cls, *, input: str, actor_tokenizer: Any, rm_tokenizer: Any, system_prompt: str | None,
               max_length: int) -> "RewardInputs":
        """``auto`` takes ids when both tokenizers are the same, else text."""
        mode = input
        if mode == "auto":
            mode = "ids" if same_tokenizer(actor_tokenizer, rm_tokenizer) else "text"
        return cls(mode=mode, rm_tokenizer=rm_tokenizer, system_prompt=system_prompt, max_length=max_length)

    def rows(self, samples: Sequence[Any], prompt_ids: Sequence[Sequence[int]],
             response_ids: Sequence[Sequence[int]], completions: Sequence[str]) -> list[list[int]]:
        """One id list per response; ``response_ids`` hold only the generated tokens (no padding)."""
        if self.mode == "ids":
            rows = [list(map(int, p)) + list(map(int, r)) for p, r in zip(prompt_ids, response_ids)]
        else:
            rows = [self._render(s, c) for s, c in zip(samples, completions)]
        return [r[-self.max_length:] for r in rows]

    def _render(self, sample: Any, completion: str) -> list[int]:
        messages = sample_messages(sample, self.system_prompt) + [{"role": "assistant", "content": completion}]
        if not has_chat_template(self.tokenizer):
            return list(map(int, self.tokenizer.encode("\n\n".join(m["content"] for m in messages))))
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        return list(map(int, self.tokenizer(text, add_special_tokens=False)["input_ids"]))


class RewardModel:
    """A Hugging Face sequence classifier with one output, sharded with FSDP2 over ``mesh`` as the
    training engine is (:mod:`spmd_rl.engine.sharding`: one unit per decoder layer plus the root; on
    a one-rank mesh the plain module), frozen. Every rank of the mesh calls
    :meth:`score` with the same ``num_micro_batches``."""

    def __init__(self, *, folder: str, mesh: DeviceMesh, device: torch.device, micro_batch_size: int,
                 param_offload: bool = False, trust_remote_code: bool = False) -> None:
        self.device = device
        self.micro_batch_size = micro_batch_size
        self.on_gpu = device.type == "cuda"
        self.param_offload = param_offload and self.on_gpu
        model = load_reward_model(folder, dtype=torch.float32, trust_remote_code=trust_remote_code)
        text = model.config.get_text_config()
        self.vocab_size = int(text.vocab_size)
        self.pad_id = int(text.pad_token_id) if text.pad_token_id is not None else 0
        # one rank: the plain module with bf16 copies of its weights per call (spmd_rl/engine/mixed.py)
        self.copies = shard_model(model, mesh=mesh, compute_dtype=torch.bfloat16 if self.on_gpu else torch.float32,
                                  sharded=mesh.size() > 1, layers_required=False)
        model.to(device)
        self.model = model
        self._head_out: torch.Tensor | None = None
        head = getattr(model, "score", None)
        if isinstance(head, torch.nn.Module):
            head.register_forward_hook(self._keep_head_output)
        if self.param_offload:
            self.model.to("cpu")

    def _keep_head_output(self, module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        self._head_out = output

    def check(self, rows: Sequence[Sequence[int]]) -> None:
        """ValueError for an empty row or a token id the model has no embedding for."""
        for i, row in enumerate(rows):
            if not row:
                raise ValueError(f"reward model input row {i} is empty")
            top = max(row)
            if top >= self.vocab_size or min(row) < 0:
                raise ValueError(
                    f"reward model input row {i} holds token id {top}, outside the reward model's vocabulary of "
                    f"{self.vocab_size} tokens; does reward.model.path use the actor's tokenizer? "
                    "(--reward.model.input text re-tokenises the text with the reward model's own)"
                )

    @torch.no_grad()
    def score(self, rows: Sequence[Sequence[int]], *, num_micro_batches: int) -> list[float]:
        """One float per row. Ranks with fewer rows run padding micro-batches so that every rank of
        the mesh makes ``num_micro_batches`` forwards (FSDP gathers parameters collectively)."""
        if self.param_offload:
            self.model.to(self.device)
        scores: list[float] = []
        size = self.micro_batch_size
        with self.copies.swapped() if self.copies is not None else nullcontext():
            for i in range(num_micro_batches):
                part = [list(r) for r in rows[i * size:(i + 1) * size]]
                real = len(part)
                scores.extend(self._forward(part or [[self.pad_id]])[:real])
        if self.param_offload:
            self.model.to("cpu")
        if self.on_gpu:
            torch.cuda.empty_cache()  # the pool then waits holding no activations
        if len(scores) != len(rows):
            raise RuntimeError(f"{num_micro_batches} micro-batches of {size} do not cover {len(rows)} rows")
        return scores

    def _forward(self, rows: list[list[int]]) -> list[float]:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = 1
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        self._head_out = None
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                         position_ids=positions.to(self.device), use_cache=False)
        if self._head_out is not None:
            logits = self._head_out[:, -1]  # per-token head output at the last column = every row's last token
        else:
            logits = out.logits
        if logits.dim() != 2 or logits.shape[1] != 1:
            raise ValueError(f"the reward model gave scores of shape {tuple(logits.shape)}; expected [batch, 1]")
        return logits[:, 0].float().cpu().tolist()


class ColocatedModelReward:
    """The reward model on the global pool (``pools.reward_ranks=0``): every rank scores its own
    rows, FSDP over the actor's mesh."""

    def __init__(self, model: RewardModel, *, group: dist.ProcessGroup | None) -> None:
        self.model = model
        self.group = group

    def check(self, rows: Sequence[Sequence[int]]) -> None:
        self.model.check(rows)

    def score(self, rows: Sequence[Sequence[int]]) -> list[float]:
        """Collective over the pool: every rank calls it, with its own (possibly no) rows."""
        count = torch.tensor([len(rows)], dtype=torch.long)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
        return self.model.score(rows, num_micro_batches=math.ceil(int(count.item()) / self.model.micro_batch_size))

    def close(self, error: str | None = None) -> None:
        pass


__all__ = ["ColocatedModelReward", "RewardInputs", "RewardModel", "resolve_reward_model", "same_tokenizer"]
