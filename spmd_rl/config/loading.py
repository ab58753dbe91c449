"""Reading a config: dataclass defaults < ``--config`` YAML preset < tyro flags; YAML and dict
round trips. Unknown YAML keys raise with the valid ones; every check runs once, after tyro has
built the objects, so a bad value surfaces as a plain ``ValueError`` naming the flag."""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from dataclasses import field
from typing import Any

import yaml

from .checks import _DEFER_CHECKS, validate
from .sections import Config

def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _from_dict(cls: type, data: dict[str, Any], where: str) -> Any:
    """Build dataclass ``cls`` from a nested dict, rejecting unknown keys with the valid ones."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = _field_types(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        norm = str(key).replace("-", "_")
        if norm not in names:
            raise ValueError(
                f"unknown config key {where + '.' if where else ''}{key}; valid keys: {', '.join(names)}"
            )
        typ = hints[norm]
        if dataclasses.is_dataclass(typ):
            kwargs[norm] = _from_dict(typ, value or {}, f"{where}.{norm}" if where else norm)
        elif isinstance(value, list) and typing.get_origin(typ) is tuple:
            kwargs[norm] = tuple(value)
        else:
            kwargs[norm] = value
    return cls(**kwargs)


def from_yaml(path: str) -> Config:
    """Read a YAML preset into a :class:`Config`; missing keys keep their defaults."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--config {path}: no such file")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    try:
        return _from_dict(Config, data, "")
    except TypeError as e:
        raise ValueError(f"--config {path}: {e}") from e


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


def load_config(argv: list[str] | None = None, *, prog: str = "spmd_rl.train", extra: type | None = None,
                description: str | None = None) -> Any:
    """Defaults, then ``--config`` YAML, then tyro flags. Returns :class:`Config`.

    With ``extra`` (a dataclass type whose fields do not clash with Config's sections), returns
    ``(config, extra_instance)``; used by tools such as the layout printer that add their own flags.
    """
    import tyro

    argv = list(sys.argv[1:] if argv is None else argv)
    path, rest = split_config_flag(argv)
    base = from_yaml(path) if path else Config()
    description = (description or Config.__doc__ or "") + (
        "\n\n--config PATH  a YAML preset (see configs/); flags given after it override it.")
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


def _combined_type(extra: type) -> type:
    """A dataclass with Config's sections plus ``extra``'s fields, for tools with their own flags."""
    fields_ = [(f.name, _field_types(Config)[f.name], field(default_factory=f.default_factory))  # type: ignore[arg-type]
               for f in dataclasses.fields(Config)]
    hints = _field_types(extra)
    for f in dataclasses.fields(extra):
        default = f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING
        fields_.append((f.name, hints[f.name], field(default=default, metadata=f.metadata)))
    return dataclasses.make_dataclass(extra.__name__ + "Flags", fields_, kw_only=True, namespace={"__doc__": extra.__doc__})


__all__ = ["from_yaml", "load_config", "split_config_flag", "to_dict", "to_yaml"]
