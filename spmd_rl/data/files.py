"""Prompt files (JSONL / Parquet) and :func:`build_prompts`, the one entry point for prompt sources.

``build_prompts(cfg.data)`` returns ``(train, val)`` lists of :class:`~spmd_rl.data.tasks.Sample`
for every ``data.task``:

* ``arithmetic`` / ``countdown`` -- generated (see :mod:`spmd_rl.data.tasks`);
* ``guess_number`` / ``python_math`` -- the built-in environments' generated rows (``--env.name``);
* ``file`` -- records with ``data.prompt_key`` (a string, or a chat list of ``{role, content}``)
  and ``data.answer_key`` (string or number); every other key becomes a scorer column;
* ``gsm8k`` -- records with ``question`` and ``answer``; the reference is the text after ``#### ``.

Validation: ``data.val_path`` when given (its first ``data.val_size`` records), else the generated
held-out split, else the last ``data.val_size`` records of ``data.path`` (removed from training).
Every error names the flag, the file and the line (JSONL) or row (Parquet).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from spmd_rl.data.tasks import Sample, generate_arithmetic, generate_countdown, generate_episode_rows

if TYPE_CHECKING:
    from spmd_rl.config import DataConfig

Located = tuple[str, dict[str, Any]]
"""A record with where it came from: ``("train.jsonl:12", {...})``."""


def _check_path(path: str, flag: str) -> None:
    if not os.path.exists(path):
        raise FileNotFoundError(f"{flag}={path}: no such file (cwd {os.getcwd()})")
    if os.path.isdir(path):
        raise ValueError(f"{flag}={path} is a folder; give a .jsonl or .parquet file")


def _read_utf8(path: str) -> str:
    """The file's text (JSON is UTF-8; a leading byte-order mark is dropped); ValueError naming the
    line and column of the first byte that is not UTF-8."""
    with open(path, "rb") as f:
        data = f.read()
    if data.startswith(b"\xef\xbb\xbf"):  # UTF-8's byte-order mark
        data = data[3:]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        start = data.rfind(b"\n", 0, e.start) + 1
        lineno = data.count(b"\n", 0, e.start) + 1
        hint = (" (it starts with a UTF-16 byte-order mark)" if data.startswith((b"\xff\xfe", b"\xfe\xff"))
                else "")
        raise ValueError(
            f"{path}:{lineno}: not UTF-8 text{hint}: byte {data[e.start:e.start + 1]!r} at column "
            f"{e.start - start + 1} ({e.reason}); save the file as UTF-8, e.g. "
            f"`iconv -f latin1 -t utf-8 IN > OUT` for a Latin-1 file") from None


def _read_jsonl(path: str) -> list[Located]:
    name = os.path.basename(path)
    out: list[Located] = []
    text = _read_utf8(path)
    if path.endswith(".json") and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}:{e.lineno}: invalid JSON ({e.msg}, column {e.colno})") from e
        for i, rec in enumerate(rows):
            where = f"{name}[{i}]"
            if not isinstance(rec, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            out.append((where, rec))
        return out
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}:{lineno}: invalid JSON ({e.msg}, column {e.colno}): {line[:80]!r}") from e
        if not isinstance(rec, dict):
            raise ValueError(f"{name}:{lineno}: expected a JSON object, got {type(rec).__name__}")
        out.append((f"{name}:{lineno}", rec))
    return out


def _read_parquet(path: str) -> list[Located]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ValueError(
            f"{path}: reading Parquet needs pyarrow ({e}); run `pip install pyarrow` or convert the file to .jsonl"
        ) from e
    name = os.path.basename(path)
    rows = pq.read_table(path).to_pylist()
    return [(f"{name} row {i + 1}", rec) for i, rec in enumerate(rows)]


def read_located(path: str, *, flag: str = "data.path") -> list[Located]:
    """Records of a ``.jsonl`` / ``.json`` / ``.parquet`` file, each with its ``file:line``."""
    _check_path(path, flag)
    if path.endswith(".parquet") or path.endswith(".pq"):
        return _read_parquet(path)
    if path.endswith(".jsonl") or path.endswith(".json"):
        return _read_jsonl(path)
    raise ValueError(f"{flag}={path}: unknown file type; use .jsonl, .json (JSON lines) or .parquet")


def read_records(path: str, *, flag: str = "data.path") -> list[dict[str, Any]]:
    """Records (dicts) of a local ``.jsonl`` / ``.json`` / ``.parquet`` file.

    Raises ``FileNotFoundError`` naming ``flag`` for a missing file and ``ValueError``
    ``file.jsonl:LINE: invalid JSON (...)`` for a malformed line.
    """
    return [rec for _, rec in read_located(path, flag=flag)]


def _get(rec: dict[str, Any], key: str, where: str, flag: str) -> Any:
    if key not in rec:
        raise ValueError(f"{where}: record has no key {key!r} ({flag}); keys present: {sorted(rec)}")
    return rec[key]


def _answer_text(value: Any, where: str, key: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{where}: answer {key!r} must be a string or a number, got {type(value).__name__}: {value!r}")
    return value if isinstance(value, str) else str(value)


def _chat(value: list[Any], where: str, key: str) -> list[dict[str, str]]:
    messages: list[dict[str, str]] = []
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: prompt {key!r} message {i} must be {{'role': str, 'content': str}}, got {m!r}")
        messages.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" for m in messages):
        raise ValueError(f"{where}: prompt {key!r} chat has no 'user' message (roles: {[m['role'] for m in messages]})")
    return messages


def file_samples(records: list[Located], *, prompt_key: str, answer_key: str) -> list[Sample]:
    """``file`` task: prompt (string or chat list) and answer columns; other keys become columns."""
    out: list[Sample] = []
    for where, rec in records:
        prompt = _get(rec, prompt_key, where, "data.prompt_key")
        answer = _answer_text(_get(rec, answer_key, where, "data.answer_key"), where, answer_key)
        columns = {k: v for k, v in rec.items() if k not in (prompt_key, answer_key, "answer")}
        if isinstance(prompt, str):
            out.append(Sample(prompt=prompt, answer=answer, columns=columns))
        elif isinstance(prompt, list):
            messages = _chat(prompt, where, prompt_key)
            last_user = [m["content"] for m in messages if m["role"] == "user"][-1]
            out.append(Sample(prompt=last_user, answer=answer, columns=columns, messages=messages))
        else:
            raise ValueError(
                f"{where}: prompt {prompt_key!r} must be a string or a list of chat messages, got {type(prompt).__name__}"
            )
    return out


def gsm8k_answer(solution: str, where: str) -> str:
    """The final answer of a GSM8K solution: the text after the last ``#### ``, commas removed."""
    if "####" not in solution:
        raise ValueError(f"{where}: GSM8K answer has no '#### N' final answer: {solution[-80:]!r}")
    final = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not final:
        raise ValueError(f"{where}: GSM8K answer has nothing after '####'")
    return final


def gsm8k_samples(records: list[Located], *, instruction: str) -> list[Sample]:
    """``gsm8k`` task: ``question`` + instruction as the prompt, the ``#### N`` value as answer."""
    suffix = f" {instruction}" if instruction else ""
    out: list[Sample] = []
    for where, rec in records:
        question = _get(rec, "question", where, "data.task=gsm8k")
        solution = _get(rec, "answer", where, "data.task=gsm8k")
        if not isinstance(question, str) or not isinstance(solution, str):
            raise ValueError(f"{where}: GSM8K 'question' and 'answer' must be strings")
        out.append(Sample(prompt=question.strip() + suffix, answer=gsm8k_answer(solution, where)))
    return out


def _file_task(cfg: DataConfig, path: str, flag: str) -> list[Sample]:
    records = read_located(path, flag=flag)
    if cfg.task == "gsm8k":
        return gsm8k_samples(records, instruction=cfg.instruction)
    return file_samples(records, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key)


GSM8K_HINT = ("GSM8K is not in the repository: docs/TRAINING.md (GSM8K data) shows how to download its two "
              "files into data/gsm8k/, where configs/gsm8k.yaml looks; the repository ships a 40-row sample: "
              "--data.path tests/data/gsm8k/train.jsonl --data.val-path tests/data/gsm8k/test.jsonl")


def _task_file(cfg: DataConfig, path: str, flag: str) -> list[Sample]:
    """:func:`_file_task`, a missing GSM8K file answered with where GSM8K comes from."""
    try:
        return _file_task(cfg, path, flag)
    except FileNotFoundError as e:
        if cfg.task != "gsm8k":
            raise
        raise FileNotFoundError(f"{e}. {GSM8K_HINT}") from None


def build_prompts(data_cfg: DataConfig) -> tuple[list[Sample], list[Sample]]:
    """``(train, val)`` samples of ``data.task``; see the module docstring for the val rules."""
    cfg = data_cfg
    if cfg.val_size < 0:
        raise ValueError(f"data.val_size must be >= 0, got {cfg.val_size}")
    if cfg.task == "arithmetic":
        train, val = generate_arithmetic(
            seed=cfg.seed, val_size=cfg.val_size, operand_min=cfg.operand_min,
            operand_max=cfg.operand_max, ops=cfg.ops, instruction=cfg.instruction,
        )
    elif cfg.task == "countdown":
        train, val = generate_countdown(
            seed=cfg.seed, val_size=cfg.val_size, countdown_numbers=cfg.countdown_numbers,
            countdown_max=cfg.countdown_max,
        )
    elif cfg.task in ("guess_number", "python_math"):
        train, val = generate_episode_rows(cfg.task, seed=cfg.seed, val_size=cfg.val_size)
    elif cfg.task in ("file", "gsm8k"):
        if cfg.path is None:
            raise ValueError(f"data.task={cfg.task} reads a file: set --data.path to a local .jsonl or .parquet file"
                             + (f". {GSM8K_HINT}" if cfg.task == "gsm8k" else ""))
        train = _task_file(cfg, cfg.path, "data.path")
        if cfg.val_path is None:
            if len(train) <= cfg.val_size:
                raise ValueError(
                    f"data.path={cfg.path} has {len(train)} records but data.val_size ({cfg.val_size}) are held out "
                    f"from its end; lower data.val_size or give data.val_path"
                )
            cut = len(train) - cfg.val_size
            train, val = train[:cut], train[cut:]
        if not train:
            raise ValueError(f"data.path={cfg.path} holds no records")
    else:
        raise ValueError(f"data.task: unknown task {cfg.task!r}; use arithmetic, countdown, guess_number, "
                         f"python_math, file or gsm8k")
    if cfg.val_path is not None:
        val = _task_file(cfg, cfg.val_path, "data.val_path")[: cfg.val_size]
    return train, val


__all__ = ["build_prompts", "file_samples", "gsm8k_answer", "gsm8k_samples", "read_located", "read_records"]
