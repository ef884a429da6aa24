"""Settings helpers: frozen dataclasses, validated on construction, strict about keys.

STYLE habit 3: settings carry units in field names (``timeout_ms``,
``capacity_rows``); unknown keys in a config mapping raise with the known keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, TypeVar

from herald.errors import ConfigError

T = TypeVar("T")


def from_mapping(cls: type[T], mapping: Mapping[str, Any] | None, *, where: str = "") -> T:
    """Build the frozen dataclass ``cls`` from ``mapping``, rejecting unknown keys.

    Raises:
        ConfigError: a key is not a field of ``cls`` (the message lists the known keys),
            or ``cls.__post_init__`` rejected a value.
    """
    mapping = dict(mapping or {})
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(mapping) - known)
    if unknown:
        label = where or cls.__name__
        raise ConfigError(
            f"unknown setting(s) {unknown} for {label}; known settings: {sorted(known)}"
        )
    return cls(**mapping)  # type: ignore[call-arg]


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
