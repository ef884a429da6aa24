"""Settings helpers: frozen dataclasses, validated on construction, strict about keys.

Settings carry units in field names (``timeout_ms``,
``capacity_rows``); unknown keys in a config mapping raise with the known keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from herald.errors import ConfigError

T = TypeVar("T")


def from_mapping(cls: type[T], mapping: Mapping[str, Any] | None, *, where: str = "") -> T:
    """Build the frozen dataclass ``cls`` from ``mapping``, rejecting unknown keys.

    Raises:
        ConfigError: a key is not a field of ``cls`` (the message lists the known keys),
            or ``cls.__post_init__`` rejected a value.
    """
    return split_options(dict(mapping or {}), cls, where=where or cls.__name__)[0]


def split_options(options: Mapping[str, Any], *classes: type, extra: tuple[str, ...] = (), where: str = "") -> list:
    """Build one settings dataclass per class from ``options`` (each key goes to the class
    that has it as a field); the keys named in ``extra`` are returned last as a dict.

    Raises:
        ConfigError: a key no class knows (the message lists the known settings).
    """
    known = {f.name: c for c in classes for f in dataclasses.fields(c)}
    unknown = sorted(set(options) - set(known) - set(extra))
    if unknown:
        raise ConfigError(
            f"unknown setting(s) {unknown} for {where}; known settings: {sorted(set(known) | set(extra))}"
        )
    out = [c(**{k: v for k, v in options.items() if known.get(k) is c}) for c in classes]
    return out + [{k: v for k, v in options.items() if k in extra}]


def parse_value(text: Any) -> Any:
    """The one string-to-value converter of settings given as text (``KEY=VALUE`` options,
    URL query strings): ``true``/``false`` -> bool, ``none`` -> None, then int, then
    float, else the string itself. Non-strings are returned unchanged.
    """
    if not isinstance(text, str):
        return text
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def key_value(text: str) -> tuple[str, str]:
    """argparse ``type`` for repeatable ``KEY=VALUE`` options (value kept as a string;
    convert it with :func:`parse_value` or a setting-specific parser)."""
    import argparse

    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    return key.strip(), value


def require(condition: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``condition`` holds.

    Used instead of ``assert`` (which vanishes under ``python -O``).
    """
    if not condition:
        raise ConfigError(message)


def setting(default: Any, help: str, **cli: Any) -> Any:
    """A dataclass field that is also a command-line option (see :func:`add_arguments`).

    ``cli`` may hold ``flag`` (default ``--field-name``), ``metavar``, ``choices``,
    ``type`` (the argparse type; default from the annotation) and ``action``
    (``"append"`` collects repeated options into a tuple).
    """
    return dataclasses.field(default=default, metadata={"help": help, **cli})


def add_arguments(parser: Any, cls: type, *, exclude: tuple[str, ...] = ()) -> None:
    """Add one argparse option per :func:`setting` field of the dataclass ``cls``.

    Defaults, types and help come from the dataclass, so they live in one place;
    ``--help`` shows each default.
    """
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "help" not in meta or f.name in exclude:
            continue
        flag = meta.get("flag", "--" + f.name.replace("_", "-"))
        kwargs: dict[str, Any] = {"dest": f.name, "help": meta["help"]}
        for key in ("metavar", "choices"):
            if key in meta:
                kwargs[key] = meta[key]
        if meta.get("action") == "append":
            kwargs.update(action="append", default=[], type=meta["type"])
        elif hints[f.name] is bool:
            kwargs.update(action="store_true", default=f.default)
        else:
            kind = meta.get("type") or next(
                (t for t in typing.get_args(hints[f.name]) if t is not type(None)), hints[f.name]
            )
            kwargs.update(type=kind, default=f.default)
            if f.default is not None:
                kwargs["help"] += " (default: %(default)s)"
        parser.add_argument(flag, **kwargs)


def from_arguments(cls: type[T], args: Any, **overrides: Any) -> T:
    """``cls`` built from the options :func:`add_arguments` added (plus ``overrides``).

    Raises:
        ConfigError: a value the dataclass rejects (its message names the flag).
    """
    values = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if "help" in f.metadata and hasattr(args, f.name):
            value = getattr(args, f.name)
            values[f.name] = tuple(value) if f.metadata.get("action") == "append" else value
    values.update(overrides)
    return cls(**values)  # type: ignore[call-arg]
