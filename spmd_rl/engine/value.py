"""The critic's value model for the FSDP engine: a decoder with a one-output token-classification head.

    model = load_value_model(folder, dtype=torch.float32, seed=0)   # AutoModelForTokenClassification, 1 label
    head = ValueHead.replace(model)                  # swaps model.score, same Parameters and names
    head.request = HeadRequest(positions=(rows, cols), labels=labels)
    out = model(...)                                 # out.logits is [1, N, 2]: (value, 0)
    head.request = None                              # a plain Linear again

This is the value model verl builds for PPO's critic: the model's decoder under
``AutoModelForTokenClassification`` with ``num_labels=1``, so each position's hidden state gives one
scalar, and no dropout before the head. Built from a causal LM's folder (the default: the actor's
model) the ``score`` head is new, initialised as Hugging Face initialises a linear layer (normal,
std ``initializer_range``, bias 0) but from its own generator seeded with the run's seed, so every
rank and every world size starts from the same head; a folder that has a ``score`` head (a saved
critic, a one-output reward model) keeps it. The value of response token ``t`` is read at the position
that predicts it (the same positions as the actor's log-probs, verl's ``values[:, -T - 1:-1]``), so
:class:`ValueHead` plugs into the engine's forward exactly where
:class:`~spmd_rl.engine.head.LogprobHead` does: the engine's ``compute_logprobs`` then returns values
and its loss functions receive values as their first argument. The head computes in fp32 (one
``[N, H] x [H]`` product) also when the decoder runs in bf16.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForTokenClassification, PreTrainedModel
from transformers.utils import logging as hf_logging

from spmd_rl.engine.head import HeadRequest

log = logging.getLogger("spmd_rl")


def load_value_model(folder: str, *, dtype: torch.dtype, seed: int, trust_remote_code: bool = False,
                     attn_implementation: str = "sdpa") -> PreTrainedModel:
    """A one-output token classifier from ``folder`` on the CPU in ``dtype``, in eval mode, without
    dropout before its head; a head the folder lacks is initialised from ``seed`` (module docstring)."""
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    config.num_labels = 1
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report lists the new head and the unused LM head: said below
    try:
        model, info = AutoModelForTokenClassification.from_pretrained(
            folder, config=config, dtype=dtype, trust_remote_code=trust_remote_code,
            attn_implementation=attn_implementation, output_loading_info=True,
            use_kernels=False)  # no Hub kernels (spmd_rl.models.load_causal_lm)
    finally:
        hf_logging.set_verbosity(verbosity)
    score = model.score
    if not isinstance(score, torch.nn.Linear) or score.out_features != 1:
        raise ValueError(f"{folder}: the token classifier's head is {score}; the critic needs a one-output nn.Linear")
    missing = set(info.get("missing_keys", ()))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if "score.weight" in missing:
            std = float(getattr(config, "initializer_range", 0.02))
            score.weight.copy_(torch.randn(score.weight.shape, generator=generator, dtype=torch.float32) * std)
        if score.bias is not None and "score.bias" in missing:
            score.bias.zero_()
    unused = sorted(info.get("unexpected_keys", ()))
    log.info("critic: %s value head (score) on the decoder of %s%s",
             "a new" if "score.weight" in missing else "the saved", folder,
             f"; unused there: {', '.join(unused)}" if unused else "")
    model.dropout = torch.nn.Identity()  # verl's critic sets classifier_dropout = 0
    model.eval()
    return model


class ValueHead(torch.nn.Module):
    """Drop-in for the one-output ``score`` Linear: a Linear while ``request`` is None, else
    ``[1, N, 2]`` (value, 0) at the requested positions, the layout of the log-prob head."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight  # the same Parameters: names stay score.weight / score.bias
        self.bias = linear.bias
        self.request: HeadRequest | None = None

    @classmethod
    def replace(cls, model: torch.nn.Module) -> ValueHead:
        head = cls(model.score)
        model.score = head
        return head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        req = self.request
        if req is None:
            return F.linear(hidden, self.weight, self.bias)
        h = hidden[req.positions].float()  # [N, H]
        bias = None if self.bias is None else self.bias.float()
        values = F.linear(h, self.weight.float(), bias).squeeze(-1)  # [N]
        return torch.stack([values[None], torch.zeros_like(values)[None]], dim=-1)  # [1, N, 2]


__all__ = ["ValueHead", "load_value_model"]
