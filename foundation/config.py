"""Config mechanics shared by every layer: dotted overrides, rebuilding from dicts, one error type.

A config is a tree of dataclasses (the experiment tree is :class:`gem.config.ExperimentConfig`; a
synthetic world's is :class:`foundation.data.synthetic.SynthConfig`). :func:`apply_overrides` sets
``section.field=value`` strings by each field's declared type, e.g. ``train.max_epochs=2
data.max_len=64``; :func:`dataclass_from_dict` rebuilds a tree from ``dataclasses.asdict`` output.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any


def dataclass_from_dict(cls: type, d: dict[str, Any]) -> Any:
    """Rebuild a (nested) config dataclass from ``dataclasses.asdict`` output, e.g. a checkpoint's."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            continue
        value, hint = d[f.name], hints[f.name]
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            value = dataclass_from_dict(hint, value)
        elif typing.get_origin(hint) is tuple and isinstance(value, list):
            value = tuple(value)
        kwargs[f.name] = value
    return cls(**kwargs)


class ConfigError(ValueError):
    """A bad flavor name or override; the message says which and what is allowed."""


def _coerce(raw: str, target_type: Any, key: str) -> Any:
    origin = typing.get_origin(target_type)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(target_type) if a is not type(None)]
        return None if raw.lower() in ("none", "null") else _coerce(raw, args[0], key)
    try:
        if target_type is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if target_type in (int, float, str):
            return target_type(raw)
        if origin is tuple:
            (elem, *_) = typing.get_args(target_type)
            parts = [p for p in raw.strip("()[] ").split(",") if p.strip()]
            return tuple(_coerce(p.strip(), elem, key) for p in parts)
        if origin is dict:
            return json.loads(raw)
    except (ValueError, json.JSONDecodeError) as exc:
        raise ConfigError(f"override {key}={raw!r}: cannot parse as {target_type}") from exc
    raise ConfigError(f"override {key}: unsupported field type {target_type}")


def apply_overrides(cfg: Any, overrides: list[str]) -> Any:
    """Apply ``section.field=value`` strings in place; values are parsed by the field's declared type."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        node = cfg
        parts = key.strip().split(".")
        for depth, part in enumerate(parts):
            if not dataclasses.is_dataclass(node):
                raise ConfigError(f"override {key!r}: {'.'.join(parts[:depth])} is not a config section")
            names = {f.name: f for f in dataclasses.fields(node)}
            if part not in names:
                raise ConfigError(f"override {key!r}: unknown field {part!r}; valid: {sorted(names)}")
            if depth == len(parts) - 1:
                hints = typing.get_type_hints(type(node))
                setattr(node, part, _coerce(raw.strip(), hints[part], key))
            else:
                node = getattr(node, part)
    return cfg
