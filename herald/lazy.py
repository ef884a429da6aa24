"""Package exports imported on first use (PEP 562), written once for every package.

A package ``__init__`` lists its public names and the submodule of each; a name is
imported the first time it is read, so building the ``herald`` parser, or a process that
needs one module, does not load every kernel (numba), torch or zmq of the package::

    _EXPORTS = {"PSClient": "client", "ShardLimits": "config"}
    __all__ = sorted(_EXPORTS)
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

or, the same in one call that sets ``__all__``, ``__getattr__`` and ``__dir__``, by submodule::

    lazy_package(globals(), {"client": ("PSClient",), "config": ("ShardLimits",)})
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str], namespace: dict[str, Any], submodules: tuple[str, ...] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package``.

    Args:
        package: the package's dotted name (``__name__``).
        exports: public name -> submodule (relative to ``package``) that defines it.
        namespace: the package's ``globals()``: a name read once is cached there.
        submodules: submodules also reachable as attributes (``herald.contracts.vocab``).

    Returns:
        ``(__getattr__, __dir__)``; ``__getattr__`` raises AttributeError naming the
        package for any other name.
    """

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        elif name in submodules:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports) | set(submodules))

    return __getattr__, __dir__


def lazy_package(
    namespace: dict[str, Any], modules: Mapping[str, Sequence[str]], submodules: tuple[str, ...] = ()
) -> None:
    """Set ``__all__``, ``__getattr__`` and ``__dir__`` of the package whose ``globals()`` is
    ``namespace`` (:func:`lazy_exports` of its ``__name__``).

    Args:
        namespace: the package's ``globals()``.
        modules: submodule (relative to the package) -> the public names it defines.
        submodules: submodules also reachable as attributes.
    """
    exports = {name: module for module, names in modules.items() for name in names}
    namespace["__all__"] = sorted(exports)
    namespace["__getattr__"], namespace["__dir__"] = lazy_exports(namespace["__name__"], exports, namespace, submodules)
