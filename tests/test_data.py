"""Tests for spmd_rl.data: generated tasks, JSONL/Parquet/GSM8K files, the resumable sampler and
chat-template rendering with a real (tiny, locally built) tokenizer.

Run with ``python3 -m pytest tests/test_data.py -q``. The Parquet test needs ``pyarrow``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from spmd_rl.config import DataConfig
from spmd_rl.data import PromptSampler, Sample, build_prompts, columns_of, read_records, render_prompts
from spmd_rl.data.tasks import generate_arithmetic, generate_countdown
from spmd_rl.reward.countdown import countdown_score, solve_countdown

from conftest import HERE

# A sample of GSM8K in its own format (tests/data/gsm8k/README.md says which rows).
GSM8K = os.path.join(HERE, "data", "gsm8k")


def _jsonl(path: Path, rows: list[object]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# --------------------------------------------------------------------------- generated tasks


def test_arithmetic_deterministic_and_disjoint() -> None:
    kw = dict(seed=7, val_size=40, operand_min=0, operand_max=30, ops="+-*", instruction="Reply with a number.")
    train, val = generate_arithmetic(**kw)
    again_train, again_val = generate_arithmetic(**kw)
    assert train == again_train and val == again_val
    other, _ = generate_arithmetic(**{**kw, "seed": 8})
    assert [s.prompt for s in other[:50]] != [s.prompt for s in train[:50]]
    assert len(val) == 40
    assert {s.prompt for s in train}.isdisjoint({s.prompt for s in val})
    for s in train[:200] + val:
        q = s.prompt.removeprefix("What is ").split("?")[0]
        a, op, b = q.split(" ")
        assert 0 <= int(a) <= 30 and 0 <= int(b) <= 30 and op in "+-*"
        assert int(s.answer) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert s.prompt.endswith("? Reply with a number.")


def test_arithmetic_small_space_is_exhausted_and_val_too_large_is_an_error() -> None:
    train, val = generate_arithmetic(seed=0, val_size=5, operand_min=1, operand_max=3, ops="+", instruction="")
    assert len(train) + len(val) == 9  # every distinct question once
    assert len({s.prompt for s in train + val}) == 9
    with pytest.raises(ValueError, match=r"data.val_size \(20\) is more than the 9 distinct arithmetic"):
        generate_arithmetic(seed=0, val_size=20, operand_min=1, operand_max=3, ops="+", instruction="")
    with pytest.raises(ValueError, match="no training questions are left"):
        generate_arithmetic(seed=0, val_size=9, operand_min=1, operand_max=3, ops="+", instruction="")


def test_countdown_solvable_deterministic_and_disjoint() -> None:
    train, val = generate_countdown(seed=3, val_size=30, countdown_numbers=3, countdown_max=12)
    assert train == generate_countdown(seed=3, val_size=30, countdown_numbers=3, countdown_max=12)[0]
    key = lambda s: (tuple(sorted(s.columns["numbers"])), s.columns["target"])  # noqa: E731
    assert {key(s) for s in train}.isdisjoint({key(s) for s in val})
    for s in val + train[:150]:
        nums, target = s.columns["numbers"], s.columns["target"]
        assert len(nums) == 3 and all(1 <= n <= 12 for n in nums) and target >= 1
        assert s.answer == str(target) and str(target) in s.prompt
        assert solve_countdown(nums, target) is not None
        assert countdown_score(f"<answer>{s.columns['solution']}</answer>", target=target, numbers=nums) == 1.0


def test_build_prompts_builtin_tasks() -> None:
    train, val = build_prompts(DataConfig(task="countdown", val_size=8, countdown_numbers=4, seed=5))
    assert len(val) == 8 and all(len(s.columns["numbers"]) == 4 for s in train[:20])
    cols = columns_of(train[:3])
    assert set(cols) == {"answer", "target", "numbers", "solution"} and len(cols["numbers"]) == 3
    train, val = build_prompts(DataConfig(task="arithmetic", val_size=4))
    assert columns_of(train[:2]) == {"answer": [train[0].answer, train[1].answer]}


# --------------------------------------------------------------------------- files


def test_file_task_jsonl_with_chat_prompts_and_holdout(tmp_path: Path) -> None:
    rows: list[dict[str, object]] = [{"q": f"question {i}", "a": i, "level": i % 3} for i in range(10)]
    rows[2] = {"q": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "chat q"}], "a": "x", "level": 0}
    path = _jsonl(tmp_path / "p.jsonl", rows)
    train, val = build_prompts(DataConfig(task="file", path=path, prompt_key="q", answer_key="a", val_size=3))
    assert [s.prompt for s in val] == ["question 7", "question 8", "question 9"]
    assert len(train) == 7 and train[1].answer == "1" and train[1].columns == {"level": 1}
    assert train[2].prompt == "chat q" and train[2].messages is not None and train[2].messages[0]["role"] == "system"
    val_path = _jsonl(tmp_path / "v.jsonl", [{"q": "held", "a": 2.5}])
    train, val = build_prompts(DataConfig(task="file", path=path, prompt_key="q", answer_key="a", val_path=val_path))
    assert len(train) == 10 and [(s.prompt, s.answer) for s in val] == [("held", "2.5")]


def test_read_records_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": 1}\n\n{"prompt": "b", "answer": 2\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: invalid JSON \("):
        read_records(str(bad))
    with pytest.raises(FileNotFoundError, match=r"data\.path=.*nope\.jsonl"):
        read_records(str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"data\.val_path="):
        build_prompts(DataConfig(task="arithmetic", val_path=str(tmp_path / "nope.jsonl")))
    path = _jsonl(tmp_path / "keys.jsonl", [{"prompt": "a", "answer": 1}, {"prompt": "b", "label": 2}])
    with pytest.raises(ValueError, match=r"keys\.jsonl:2: record has no key 'answer' \(data\.answer_key\); keys present: \['label', 'prompt'\]"):
        build_prompts(DataConfig(task="file", path=path, val_size=0))
    path = _jsonl(tmp_path / "list.jsonl", [[1, 2]])
    with pytest.raises(ValueError, match=r"list\.jsonl:1: expected a JSON object, got list"):
        read_records(path)
    path = _jsonl(tmp_path / "few.jsonl", [{"prompt": "a", "answer": 1}] * 3)
    with pytest.raises(ValueError, match=r"has 3 records but data\.val_size \(5\)"):
        build_prompts(DataConfig(task="file", path=path, val_size=5))
    with pytest.raises(ValueError, match="unknown file type"):
        (tmp_path / "x.csv").write_text("a,b\n")
        read_records(str(tmp_path / "x.csv"))


def test_non_utf8_file_names_the_line(tmp_path: Path) -> None:
    """A Latin-1 (or UTF-16) file is an error naming the file, line and column, not a bare
    UnicodeDecodeError with a byte offset; a UTF-8 byte-order mark is harmless."""
    import re

    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"prompt": "a", "answer": 1}\n{"prompt": "caf\u00e9", "answer": 2}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=re.escape(f"{latin}:2: not UTF-8 text: byte b'\\xe9' at column 16 "
                                                   "(invalid continuation byte); save the file as UTF-8")):
        read_records(str(latin))
    wide = tmp_path / "wide.jsonl"
    wide.write_bytes('{"prompt": "a", "answer": 1}\n'.encode("utf-16"))
    with pytest.raises(ValueError, match=r"wide\.jsonl:1: not UTF-8 text \(it starts with a UTF-16 byte-order mark\)"):
        read_records(str(wide))
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes('{"prompt": "caf\u00e9", "answer": 1}\n'.encode("utf-8-sig"))
    assert read_records(str(bom)) == [{"prompt": "caf\u00e9", "answer": 1}]


def test_json_lines_and_array(tmp_path: Path) -> None:
    (tmp_path / "l.json").write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n')
    (tmp_path / "arr.json").write_text('[{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]')
    assert read_records(str(tmp_path / "l.json")) == read_records(str(tmp_path / "arr.json"))


def test_parquet(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"prompt": ["p0", "p1", "p2"], "answer": [3, 4, 5], "extra": ["x", "y", "z"]})
    pq.write_table(table, tmp_path / "d.parquet")
    train, val = build_prompts(DataConfig(task="file", path=str(tmp_path / "d.parquet"), val_size=1))
    assert [(s.prompt, s.answer, s.columns) for s in train] == [("p0", "3", {"extra": "x"}), ("p1", "4", {"extra": "y"})]
    assert val[0].prompt == "p2"
    pq.write_table(pa.table({"prompt": ["p0"]}), tmp_path / "k.parquet")
    with pytest.raises(ValueError, match=r"k\.parquet row 1: record has no key 'answer'"):
        build_prompts(DataConfig(task="file", path=str(tmp_path / "k.parquet"), val_size=0))


def test_parquet_without_pyarrow_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow` raise ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ValueError, match=r"d\.parquet: reading Parquet needs pyarrow .*pip install pyarrow"):
        read_records(str(tmp_path / "d.parquet"))


def test_gsm8k_real_file_and_errors(tmp_path: Path) -> None:
    cfg = DataConfig(task="gsm8k", path=f"{GSM8K}/test.jsonl", val_size=19, instruction="Answer with a number.")
    train, val = build_prompts(cfg)
    assert len(train) == 23 and len(val) == 19  # the sample's 42 rows
    assert train[0].answer == "18" and train[0].prompt.startswith("Janet") and train[0].prompt.endswith("Answer with a number.")
    assert all(s.answer.lstrip("-").replace(".", "").isdigit() for s in train + val)
    # a reference with thousands separators loses its commas
    with open(f"{GSM8K}/test.jsonl") as f:
        lines = f.readlines()
    with_comma = next(i for i, line in enumerate(lines) if json.loads(line)["answer"].rsplit("####", 1)[1].count(",") > 0)
    expected = json.loads(lines[with_comma])["answer"].rsplit("####", 1)[1].strip().replace(",", "")
    assert (train + val)[with_comma].answer == expected
    path = _jsonl(tmp_path / "g.jsonl", [{"question": "q1", "answer": "x\n#### 1,234"}, {"question": "q2", "answer": "so 5"}])
    with pytest.raises(ValueError, match=r"g\.jsonl:2: GSM8K answer has no '#### N'"):
        build_prompts(DataConfig(task="gsm8k", path=path, val_size=0))


# --------------------------------------------------------------------------- sampler


def test_sampler_epochs_and_boundary() -> None:
    s = PromptSampler(10, batch_size=4, seed=1)
    batches = [s.next_batch() for _ in range(5)]  # 20 draws = exactly two epochs
    flat = [i for b in batches for i in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] == s.epoch_order(0) and flat[10:] == s.epoch_order(1)
    assert flat[:10] != flat[10:]
    assert batches[2] == flat[8:12]  # spans the epoch boundary
    assert s.state_dict() == {"epoch": 2, "position": 0, "num_items": 10, "seed": 1}
    big = PromptSampler(3, batch_size=7, seed=0).next_batch()
    assert len(big) == 7 and sorted(big[:3]) == [0, 1, 2] and sorted(big[3:6]) == [0, 1, 2]


def test_sampler_resume_draws_the_same_batches() -> None:
    a = PromptSampler(13, batch_size=5, seed=42)
    for _ in range(4):
        a.next_batch()
    state = a.state_dict()
    expected = [a.next_batch() for _ in range(9)]
    b = PromptSampler(13, batch_size=5, seed=42)
    b.load_state_dict(json.loads(json.dumps(state)))
    assert [b.next_batch() for _ in range(9)] == expected
    with pytest.raises(ValueError, match="saved with 13 prompts but this run has 12"):
        PromptSampler(12, batch_size=5, seed=42).load_state_dict(state)
    with pytest.raises(ValueError, match="data.seed=42 but this run has data.seed=0"):
        PromptSampler(13, batch_size=5, seed=0).load_state_dict(state)


# --------------------------------------------------------------------------- rendering


def _tiny_tokenizer(chat_template: str | None):  # type: ignore[no-untyped-def]
    """A character-level tokenizer built locally (no download), with an optional chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}
    for c in [chr(i) for i in range(32, 127)] + ["\n"]:
        vocab.setdefault(c, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    tok.chat_template = chat_template
    return tok


TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"


def test_render_prompts_chat_template_and_dropping() -> None:
    tok = _tiny_tokenizer(TEMPLATE)
    samples = [Sample(prompt="hi", answer="1"), Sample(prompt="x" * 50, answer="2"), Sample(prompt="hey", answer="3"),
               Sample(prompt="ignored", answer="4", messages=[{"role": "user", "content": "chat"}])]
    kept, ids, dropped = render_prompts(samples, tok, system_prompt=None, max_prompt_length=22)  # 18 + content
    assert dropped == 1 and [s.answer for s in kept] == ["1", "3", "4"]
    assert all(type(r) is list and all(type(t) is int for t in r) for r in ids)
    assert tok.decode(ids[0]) == "[user]hi\n[assistant]"
    assert tok.decode(ids[2]) == "[user]chat\n[assistant]"
    assert len(ids[0]) == len("[user]hi\n[assistant]")
    kept, ids, dropped = render_prompts(samples, tok, system_prompt="S", max_prompt_length=100)
    assert dropped == 0 and tok.decode(ids[0]) == "[system]S\n[user]hi\n[assistant]"
    assert tok.decode(ids[3]) == "[system]S\n[user]chat\n[assistant]"
    with pytest.raises(ValueError, match=r"data\.max_prompt_length \(5\).*shortest has 20 tokens"):
        render_prompts(samples, tok, system_prompt=None, max_prompt_length=5)
    assert render_prompts([], tok, system_prompt=None, max_prompt_length=5) == ([], [], 0)


def test_render_prompts_without_chat_template_uses_raw_text() -> None:
    tok = _tiny_tokenizer(None)
    kept, ids, dropped = render_prompts([Sample(prompt="2+2?", answer="4")], tok, system_prompt="sys", max_prompt_length=50)
    assert dropped == 0 and tok.decode(ids[0]) == "sys\n\n2+2?"


def test_render_real_gsm8k_prompts_counts() -> None:
    tok = _tiny_tokenizer(TEMPLATE)
    train, _ = build_prompts(DataConfig(task="gsm8k", path=f"{GSM8K}/test.jsonl", val_size=0, instruction=""))
    kept, ids, dropped = render_prompts(train, tok, system_prompt=None, max_prompt_length=200)
    overhead = len("[user]\n[assistant]")
    expect_dropped = sum(len(s.prompt) + overhead > 200 for s in train)
    assert 0 < dropped == expect_dropped < len(train) and len(kept) == len(ids) == len(train) - dropped
    assert all(len(r) <= 200 for r in ids)


def test_model_inputs_left_pad_prompts_and_right_pad_responses() -> None:
    from spmd_rl.data.batch import RolloutBatch

    batch = RolloutBatch(prompts=[[5, 6, 7], [8], []], tensors={
        "response_ids": torch.tensor([[11, 12], [13, 0], [14, 15]]),
        "response_mask": torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])})
    inputs = batch.model_inputs(pad_token_id=0)
    assert inputs.prompt_width == 3 and inputs.response_len == 2
    assert inputs.input_ids.tolist() == [[5, 6, 7, 11, 12], [0, 0, 8, 13, 0], [0, 0, 0, 14, 15]]
    assert inputs.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    assert inputs.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 1, 1], [0, 0, 0, 0, 1]]
