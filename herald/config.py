"""Settings helpers: frozen dataclasses, validated on construction, strict about keys.

Settings carry units in field names (``timeout_ms``,
``capacity_rows``); unknown keys in a config mapping raise with the known keys. A
settings class may nest others (:func:`nested`) while its options stay flat: one
command-line flag per setting (:func:`options`, :func:`from_flags`, :func:`flags_of`).
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
        ConfigError: a key no class knows (the message lists the known settings), or a
            field without a default missing from ``options``.
    """
    known = {f.name: c for c in classes for f in dataclasses.fields(c)}
    unknown = sorted(set(options) - set(known) - set(extra))
    if unknown:
        raise ConfigError(
            f"unknown setting(s) {unknown} for {where}; known settings: {sorted(set(known) | set(extra))}"
        )
    required = [
        f.name
        for c in classes
        for f in dataclasses.fields(c)
        if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [name for name in required if name not in options]
    if missing:
        raise ConfigError(f"{where}: missing setting(s) {missing}; give them (known settings: {sorted(known)})")
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


def add_key_value_option(parser, flag: str, help: str) -> None:
    """Add the repeatable ``flag KEY=VALUE`` option to the argparse ``parser`` (a list of
    ``(key, value)`` pairs by :func:`key_value`, empty by default)."""
    parser.add_argument(flag, type=key_value, action="append", default=[], metavar="KEY=VALUE", help=help)


def require(condition: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``condition`` holds.

    Used instead of ``assert`` (which vanishes under ``python -O``).
    """
    if not condition:
        raise ConfigError(message)


def setting(default: Any, help: str, **cli: Any) -> Any:
    """A dataclass field that is also a command-line option (see :func:`add_arguments`).

    ``cli`` may hold ``flag`` (default ``--`` + the option's name with dashes), ``dest``
    (the option's flat name inside a nested settings class, default its prefix + the field
    name: :class:`Nested`), ``metavar``, ``choices``, ``type`` (the argparse type; default
    from the annotation) and ``action`` (``"append"`` collects repeated options into a tuple).
    """
    return dataclasses.field(default=default, metadata={"help": help, **cli})


@dataclasses.dataclass(frozen=True)
class Option:
    """One command-line option of a settings dataclass (flat, whether its field is nested or not).

    Attributes:
        dest: its flat name: the argparse ``dest``, the key of :func:`flags_of` and :func:`from_flags`.
        default: its default value; kind: the field's annotation; meta: the :func:`setting` metadata.
    """

    dest: str
    default: Any
    kind: Any
    meta: Mapping[str, Any]


def _field_default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


class Nested:
    """The flat options of a nested settings dataclass ``cls``: each of its :func:`setting`
    fields is the option ``prefix + field name`` (or the field's own ``dest``), so that the
    command line stays flat while the settings nest (``--cache-rows`` is ``cfg.cache.rows``).

    A settings field that nests a class with a choice of classes (the consistency modes)
    gives its own object with the same three methods: :meth:`options`, :meth:`build`, :meth:`flatten`.
    """

    def __init__(self, cls: type, prefix: str = ""):
        self.cls, self.prefix = cls, prefix

    def options(self) -> list[Option]:
        """One :class:`Option` per :func:`setting` field of ``cls``, in field order."""
        import typing

        hints = typing.get_type_hints(self.cls)
        return [
            Option(f.metadata.get("dest", self.prefix + f.name), _field_default(f), hints[f.name], f.metadata)
            for f in dataclasses.fields(self.cls)
            if "help" in f.metadata
        ]

    def _dests(self) -> list[tuple[str, str]]:
        return [(f.name, f.metadata.get("dest", self.prefix + f.name)) for f in dataclasses.fields(self.cls)]

    def build(self, values: Mapping[str, Any]) -> Any:
        """``cls`` from the options given in ``values`` (flat names; the others keep their defaults).

        Raises:
            ConfigError: a value ``cls`` rejects.
        """
        return self.cls(**{name: values[dest] for name, dest in self._dests() if dest in values})

    def flatten(self, obj: Any) -> dict[str, Any]:
        """The options of ``obj`` (an instance of ``cls``) by flat name: the inverse of :meth:`build`."""
        return {dest: getattr(obj, name) for name, dest in self._dests()}


def nested(cls: type, *, prefix: str = "", flags: Any = None) -> Any:
    """A settings field holding a settings dataclass (default ``cls()``), whose options are
    flat flags: those of ``flags``, by default :class:`Nested` ``(cls, prefix)``."""
    return dataclasses.field(default_factory=cls, metadata={"nested": flags or Nested(cls, prefix)})


def options(cls: type) -> list[Option]:
    """Every command-line option of the settings dataclass ``cls``, nested ones flattened, in field order.

    Raises:
        ConfigError: two options with one flat name (a bug of the settings classes).
    """
    import typing

    hints = typing.get_type_hints(cls)
    out: list[Option] = []
    for f in dataclasses.fields(cls):
        if "nested" in f.metadata:
            out.extend(f.metadata["nested"].options())
        elif "help" in f.metadata:
            out.append(Option(f.name, _field_default(f), hints[f.name], f.metadata))
    seen = [o.dest for o in out]
    if len(set(seen)) != len(seen):
        raise ConfigError(f"{cls.__name__}: options {sorted({d for d in seen if seen.count(d) > 1})} defined twice")
    return out


def from_flags(cls: type[T], values: Mapping[str, Any] | None = None, *, where: str = "") -> T:
    """The settings dataclass ``cls`` from its options by flat name (:func:`options`; the
    command line's names, ``cache_rows`` for ``--cache-rows``): nested settings are built
    from theirs, options not given keep their defaults.

    Raises:
        ConfigError: a name that is no option of ``cls`` (the message lists the known ones),
            or a value a settings class rejects.
    """
    values = dict(values or {})
    known = [o.dest for o in options(cls)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown} for {where or cls.__name__}; known settings: {sorted(known)}")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if "nested" in f.metadata:
            group = f.metadata["nested"]
            kwargs[f.name] = group.build({o.dest: values[o.dest] for o in group.options() if o.dest in values})
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)


def flags_of(obj: Any) -> dict[str, Any]:
    """The options of the settings dataclass ``obj`` by flat name: the inverse of :func:`from_flags`
    (JSON-able when the values are)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if "nested" in f.metadata:
            out.update(f.metadata["nested"].flatten(getattr(obj, f.name)))
        elif "help" in f.metadata:
            out[f.name] = getattr(obj, f.name)
    return out


def add_arguments(parser: Any, cls: type, *, exclude: tuple[str, ...] = ()) -> None:
    """Add one argparse option per :func:`options` entry of the dataclass ``cls`` (``exclude``:
    flat names left out).

    Defaults, types and help come from the dataclass, so they live in one place;
    ``--help`` shows each default.
    """
    import typing

    for o in options(cls):
        meta = o.meta
        if o.dest in exclude:
            continue
        flag = meta.get("flag", "--" + o.dest.replace("_", "-"))
        kwargs: dict[str, Any] = {"dest": o.dest, "help": meta["help"]}
        for key in ("metavar", "choices"):
            if key in meta:
                kwargs[key] = meta[key]
        if meta.get("action") == "append":
            kwargs.update(action="append", default=[], type=meta["type"])
        elif o.kind is bool:
            kwargs.update(action="store_true", default=o.default)
        else:
            kind = meta.get("type") or next((t for t in typing.get_args(o.kind) if t is not type(None)), o.kind)
            kwargs.update(type=kind, default=o.default)
            if o.default is not None:
                kwargs["help"] += " (default: %(default)s)"
        parser.add_argument(flag, **kwargs)


def from_arguments(cls: type[T], args: Any, **overrides: Any) -> T:
    """``cls`` built from the options :func:`add_arguments` added (plus ``overrides``, by flat name).

    Raises:
        ConfigError: a value the dataclass rejects (its message names the flag).
    """
    values = {}
    for o in options(cls):
        if hasattr(args, o.dest):
            value = getattr(args, o.dest)
            values[o.dest] = tuple(value) if o.meta.get("action") == "append" else value
    values.update(overrides)
    return from_flags(cls, values)
