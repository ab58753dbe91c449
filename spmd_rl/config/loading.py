"""Reading a config: dataclass defaults < ``--config`` YAML preset < tyro flags; YAML and dict
round trips. Unknown YAML keys raise with the valid ones; every YAML value is checked against its
field's type (``preset.yaml: actor.lr: expected a number, got the string 'abc'``), converted only
where nothing is lost (``1e-5``, which PyYAML reads as a string, for a float; ``8.0`` for an int;
never a string for a bool); every check runs once, after tyro has built the objects, so a bad value
surfaces as a plain ``ValueError`` naming the flag."""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import types
import typing
from dataclasses import field
from typing import Any, Literal

import yaml

from .checks import _DEFER_CHECKS, validate
from .sections import Config

def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


# A number as YAML 1.2 writes it. PyYAML follows YAML 1.1, where a float needs a dot: it reads
# `1e-5` as the string '1e-5', which a float (or int) field takes as the number it spells.
_NUMBER = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
_BOOL_WORDS = "YAML reads unquoted true/false/yes/no/on/off as booleans"


def _describe(value: Any) -> str:
    """A YAML value as the error messages name it."""
    if value is None:
        return "null (an empty value)"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, int):
        return f"the integer {value}"
    if isinstance(value, float):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, list):
        return f"the list {value!r}"
    if isinstance(value, dict):
        return "a mapping"
    return f"{type(value).__name__} {value!r}"


def _convert(value: Any, typ: Any, key: str) -> Any:
    """``value`` read from YAML as field type ``typ``, converted only where nothing is lost (an
    integer or a number-like string for a float; an integral float for an int); ValueError
    ``key: expected ..., got ...`` otherwise."""
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if dataclasses.is_dataclass(typ):
        return _from_dict(typ, {} if value is None else value, key)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _convert(value, option, key)
            except ValueError as e:
                errors.append(e)
        if len(options) == 1:
            raise errors[0]
        raise ValueError(f"{key}: expected one of {options}, got {_describe(value)}")
    if origin is Literal:
        if isinstance(value, float) and value.is_integer() and int(value) in args:
            value = int(value)  # as for an int field
        for choice in args:  # `True == 1` in Python: compare the types too
            if value == choice and type(value) is type(choice):
                return choice
        hint = f" ({_BOOL_WORDS}: put the word in quotes)" if isinstance(value, bool) else ""
        raise ValueError(f"{key}: expected one of {', '.join(repr(a) for a in args)}, got {_describe(value)}{hint}")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key}: expected a list, got {_describe(value)}")
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise ValueError(f"{key}: expected a list of {len(args)} values, got {len(value)}: {list(value)!r}")
            return tuple(_convert(v, t, f"{key}[{i}]") for i, (v, t) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        out = [_convert(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str):  # never guessed: "false" would be True to Python
            word = {"true": "true", "yes": "true", "on": "true", "false": "false", "no": "false", "off": "false"}
            meant = word.get(value.strip().lower(), "true or false")
            raise ValueError(f"{key}: expected true or false, got {_describe(value)}: write {meant} without quotes")
        raise ValueError(f"{key}: expected true or false, got {_describe(value)}")
    if typ is int:
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):  # PyYAML's string for `1e3`
            value = int(value) if value.strip().lstrip("+-").isdigit() else float(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValueError(f"{key}: expected an integer, got {_describe(value)}")
    if typ is float:
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            return float(value)
        if isinstance(value, float):
            return value
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**53:  # exact as a float
            return float(value)
        raise ValueError(f"{key}: expected a number, got {_describe(value)}")
    if typ is str:
        if isinstance(value, str):
            return value
        hint = _BOOL_WORDS + ": " if isinstance(value, bool) else ""
        raise ValueError(f"{key}: expected a string, got {_describe(value)} ({hint}put it in quotes)")
    return value


def _from_dict(cls: type, data: dict[str, Any], where: str) -> Any:
    """Build dataclass ``cls`` from a nested dict, rejecting unknown keys with the valid ones and
    values that do not fit their field's type (see :func:`_convert`)."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'}: expected a mapping of keys to values, got {_describe(data)}")
    hints = _field_types(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        norm = str(key).replace("-", "_")
        if norm not in names:
            raise ValueError(
                f"unknown config key {where + '.' if where else ''}{key}; valid keys: {', '.join(names)}"
            )
        kwargs[norm] = _convert(value, hints[norm], f"{where}.{norm}" if where else norm)
    return cls(**kwargs)


# Keys that moved to another section, old -> new: a run's config.yaml written before a move still
# loads (``python -m spmd_rl.evaluate --config RUN_DIR/config.yaml``); the new key wins when both are set.
MOVED_KEYS = {("rollout", "val_temperature"): ("trainer", "val_temperature")}


def _move_keys(data: Any) -> Any:
    if not isinstance(data, dict):
        return data
    for (old_section, old_key), (new_section, new_key) in MOVED_KEYS.items():
        old = data.get(old_section)
        if isinstance(old, dict) and old_key in old:
            value = old.pop(old_key)
            new = data.setdefault(new_section, {})
            if isinstance(new, dict):
                new.setdefault(new_key, value)
    return data


def from_yaml(path: str) -> Config:
    """Read a YAML preset into a :class:`Config`; missing keys keep their defaults."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--config {path}: no such file")
    with open(path, "rb") as f:
        text = f.read()
    try:
        data = _move_keys(yaml.safe_load(text) or {})
    except yaml.YAMLError as e:  # a syntax error: one line with the file, line and column
        raise ValueError(_yaml_error(path, e)) from None
    try:
        return _from_dict(Config, data, "")
    except (TypeError, ValueError) as e:  # every message names the file and the key
        raise ValueError(f"{path}: {e}") from e


def _yaml_error(path: str, e: yaml.YAMLError) -> str:
    """``preset.yaml:3:7: YAML syntax error: mapping values are not allowed here`` (PyYAML's marks are 0-based)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    context = getattr(e, "context", None)
    return f"{where}: YAML syntax error: {problem}" + (f" ({context})" if context else "")


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config (tuples become lists), for YAML/JSON."""
    def conv(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, tuple):
            return [conv(x) for x in v]
        return v

    return conv(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def split_config_flag(argv: list[str]) -> tuple[str | None, list[str]]:
    """Pull ``--config PATH`` (or ``--config=PATH``) out of argv."""
    rest: list[str] = []
    path = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ValueError("--config needs a path to a YAML file")
            path = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return path, rest


_LIST_ITEM = re.compile(r"^([-*•]|\d+[.)])\s")


def paragraphs(text: str) -> str:
    """Help text as paragraphs: the lines of a docstring (first line flush, the rest indented, as
    written in the source) joined into one line per paragraph, which ``--help`` then wraps to the
    terminal. A blank line ends a paragraph; a line indented deeper than the text (a code example)
    or starting a list item keeps its own line."""
    lines = text.expandtabs().split("\n")
    rest = [line for line in lines[1:] if line.strip()]
    margin = min((len(line) - len(line.lstrip()) for line in rest), default=0)
    lines = [lines[0].strip()] + [line[margin:].rstrip() for line in lines[1:]]
    out: list[str] = []
    for line in lines:
        joins = (out and out[-1] and line and not line[0].isspace() and not out[-1][0].isspace()
                 and not _LIST_ITEM.match(line))
        if joins:
            out[-1] += " " + line
        elif line or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip("\n")


def _wrapped(text: str) -> str:
    """A description as paragraphs wrapped to the terminal (at most 100 columns); code lines as written.
    tyro prints a description as it is given, where a field's help is wrapped for it."""
    import shutil
    import textwrap

    width = min(shutil.get_terminal_size((100, 24)).columns, 100) - 1
    out = "\n".join(line if not line or line[0].isspace() else textwrap.fill(line, width, break_on_hyphens=False)
                    for line in paragraphs(text).split("\n"))
    _AS_GIVEN.add(out)
    return out


_AS_GIVEN: set[str] = set()
"""Texts already laid out (a wrapped description): tyro's joiner gives them back unchanged."""


def _tyro_joiner(text: str) -> str:
    return text if text in _AS_GIVEN else paragraphs(text)


def _use_paragraphs() -> None:
    """Make tyro join a docstring's lines into paragraphs (:func:`paragraphs`). tyro's own joiner
    runs before the dedent and keeps a break before any line that does not start with a letter, so
    every continuation line of an indented docstring started a new line in ``--help``."""
    from tyro import _strings

    _strings.remove_single_line_breaks = _tyro_joiner


def load_config(argv: list[str] | None = None, *, prog: str = "spmd_rl.train", extra: type | None = None,
                description: str | None = None) -> Any:
    """Defaults, then ``--config`` YAML, then tyro flags. Returns :class:`Config`.

    With ``extra`` (a dataclass type whose fields do not clash with Config's sections), returns
    ``(config, extra_instance)``; used by tools such as the layout printer that add their own flags.
    """
    import tyro

    _use_paragraphs()
    argv = list(sys.argv[1:] if argv is None else argv)
    path, rest = split_config_flag(argv)
    base = from_yaml(path) if path else Config()
    description = _wrapped((description or Config.__doc__ or "") + (
        "\n\n--config PATH  a YAML preset (see configs/); flags given after it override it."))
    token = _DEFER_CHECKS.set(True)
    try:
        if extra is None:
            out = tyro.cli(Config, default=base, args=rest, prog=prog, description=description)
        else:
            combined = _combined_type(extra)
            defaults = {f.name: getattr(base, f.name) for f in dataclasses.fields(Config)}
            out = tyro.cli(combined, default=combined(**defaults), args=rest, prog=prog, description=description)
        cfg = Config(**{f.name: getattr(out, f.name) for f in dataclasses.fields(Config)})
    finally:
        _DEFER_CHECKS.reset(token)
    validate(cfg)
    if extra is None:
        return cfg
    return cfg, extra(**{f.name: getattr(out, f.name) for f in dataclasses.fields(extra)})


def _field_docstrings(cls: type) -> dict[str, str]:
    """Each field's docstring (the string under it in the class body). tyro reads them from the
    class's source, which the combined dataclass below has none of."""
    import ast
    import inspect
    import textwrap

    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    except (OSError, TypeError, IndexError, AttributeError):
        return {}
    return {node.target.id: after.value.value for node, after in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)}


def _combined_type(extra: type) -> type:
    """A dataclass with Config's sections plus ``extra``'s fields, for tools with their own flags."""
    import tyro

    fields_ = [(f.name, _field_types(Config)[f.name], field(default_factory=f.default_factory))  # type: ignore[arg-type]
               for f in dataclasses.fields(Config)]
    hints, docs = _field_types(extra), _field_docstrings(extra)
    for f in dataclasses.fields(extra):
        default = f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING
        hint = hints[f.name]
        if f.name in docs and typing.get_origin(hint) is not typing.Annotated:  # the docstring, as tyro shows it
            hint = typing.Annotated[hint, tyro.conf.arg(help=paragraphs(docs[f.name]))]
        fields_.append((f.name, hint, field(default=default, metadata=f.metadata)))
    return dataclasses.make_dataclass(extra.__name__ + "Flags", fields_, kw_only=True, namespace={"__doc__": extra.__doc__})


__all__ = ["from_yaml", "load_config", "split_config_flag", "to_dict", "to_yaml"]
