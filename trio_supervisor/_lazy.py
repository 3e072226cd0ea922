"""Names a package exports but imports only when first asked for (PEP 562).

The face loads the engine at once and an adapter when it is named; ``testing`` loads
the kits that need pytest or Hypothesis when they are named. Each package gives its
table of name -> module; a name is imported once, then kept in the package.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, modules: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package`` for the names in ``modules``.

    Args:
        package: The package's ``__name__``.
        modules: Each lazily exported name, and the module (relative to ``package``)
            that defines it.
    """
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *modules})

    return __getattr__, __dir__
