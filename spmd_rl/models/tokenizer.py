"""Tokenizers: loading a model folder's tokenizer, and the built-in character tokenizer.

    tok = load_tokenizer(folder)                 # pad token set, left padding for generation
    tok = build_char_tokenizer()                 # the `tiny-random` model's tokenizer
    eos = eos_token_ids(tok)                     # EOS and the chat formats' end-of-turn ids
    texts = decode_responses(tok, ids, mask)     # [B, T] response ids + mask -> one string per row

The character tokenizer maps each printable ASCII character (plus tab and newline) to one token,
after a handful of special tokens. It is built with the `tokenizers` library (a BPE model with no
merges, so every character is its own token) and wrapped in ``PreTrainedTokenizerFast`` with a
Jinja chat template, so prompts render exactly as they do for a real instruct model::

    <|system|>...</s><|user|>What is 2+3?</s><|assistant|>
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

if TYPE_CHECKING:
    import torch

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, *ROLE_TOKENS.values()]
CHARACTERS = ["\t", "\n"] + [chr(c) for c in range(32, 127)]

# Each turn is `<|role|>content</s>`; the assistant prompt is `<|assistant|>`, so a model that
# learned the format ends its answer with `</s>` (its EOS token).
CHAR_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('tiny-random chat template: unknown role ' ~ message['role'] ~ "
    "'; use system, user or assistant') }}"
    "{%- endif -%}"
    "{{ '<|' ~ message['role'] ~ '|>' ~ message['content'] ~ '</s>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)


def build_char_tokenizer(*, model_max_length: int = 512) -> PreTrainedTokenizerFast:
    """The built-in character-level tokenizer: special tokens first, then printable ASCII.

    Ids: ``<pad>`` 0, ``<s>`` 1, ``</s>`` 2 (EOS), ``<unk>`` 3, ``<|system|>`` 4, ``<|user|>`` 5,
    ``<|assistant|>`` 6, then tab, newline and the characters 32..126. Any other character
    encodes as ``<unk>``.
    """
    from tokenizers import Tokenizer, decoders, models

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.decoder = decoders.Fuse()  # join characters with nothing between them
    backend.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        chat_template=CHAR_CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )
    tok.padding_side = "left"
    return tok


# A Hugging Face tokenizer's vocabulary is in one of these (tokenizer_config.json, next to it, holds
# the class, the special tokens and the chat template).
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json + merges.txt", "vocab.txt", "spiece.model",
                    "sentencepiece.bpe.model", "*.tiktoken")


def check_tokenizer_files(folder: str) -> None:
    """ValueError naming what is missing when the local ``folder`` holds no tokenizer vocabulary."""
    if not os.path.isdir(folder):
        return
    names = set(os.listdir(folder))
    if any(n.endswith(".tiktoken") for n in names) or any(
            all(part in names for part in f.split(" + ")) for f in VOCABULARY_FILES if "*" not in f):
        return
    has = "only vocab.json, without merges.txt," if "vocab.json" in names else "none of them"
    config = "" if "tokenizer_config.json" in names else " and no tokenizer_config.json"
    held = sorted(names)
    held_text = ", ".join(held[:12]) + (f" and {len(held) - 12} more" if len(held) > 12 else "")
    raise ValueError(
        f"{folder}: no tokenizer there: a Hugging Face tokenizer needs tokenizer.json (or tokenizer.model, "
        f"or vocab.json + merges.txt, or vocab.txt) with its tokenizer_config.json, and this folder has {has}"
        f"{config} (it holds {held_text or 'nothing'}); copy those files from the model the "
        f"weights come from")


def load_tokenizer(folder: str, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a local model folder, ready for batched generation.

    The pad token falls back to the EOS token when the folder defines none, and padding is on the
    left (prompts end where generation starts). A folder without tokenizer files (weights copied
    alone) is a ``ValueError`` saying which files a tokenizer needs.
    """
    check_tokenizer_files(folder)
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(
                f"--model.path {folder}: the tokenizer defines neither a pad token nor an EOS token; "
                "set `pad_token` or `eos_token` in its tokenizer_config.json"
            )
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


# End-of-turn tokens of common chat formats (ChatML, Llama 3): a chat model may end its reply with
# one of them rather than with the tokenizer's own EOS token.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")


def eos_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end a response, sorted: the tokenizer's EOS id and whichever
    :data:`END_OF_TURN_TOKENS` its vocabulary holds."""
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    vocab = tokenizer.get_vocab()
    ids.update(int(vocab[tok]) for tok in END_OF_TURN_TOKENS if tok in vocab)
    return sorted(ids)


def response_tokens(ids: "torch.Tensor", mask: "torch.Tensor") -> list[list[int]]:
    """Each row's response tokens: the ids of ``[B, T]`` ``ids`` where ``[B, T]`` ``mask`` is set."""
    return [row[keep.bool()].tolist() for row, keep in zip(ids, mask)]


def decode_responses(tokenizer: PreTrainedTokenizerBase, ids: "torch.Tensor", mask: "torch.Tensor") -> list[str]:
    """Each row's response as text (special tokens skipped)."""
    return decode_tokens(tokenizer, response_tokens(ids, mask))


def decode_tokens(tokenizer: PreTrainedTokenizerBase, tokens: list[list[int]]) -> list[str]:
    """Responses' token lists as text (special tokens skipped); no rows give no texts (``batch_decode``
    of nothing gives one empty string)."""
    return tokenizer.batch_decode(tokens, skip_special_tokens=True) if tokens else []


__all__ = ["CHAR_CHAT_TEMPLATE", "END_OF_TURN_TOKENS", "SPECIAL_TOKENS", "build_char_tokenizer", "decode_responses",
           "decode_tokens", "eos_token_ids", "load_tokenizer", "response_tokens"]
