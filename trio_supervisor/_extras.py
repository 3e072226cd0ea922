"""What the optional parts of the package need, and the error that says how to get it.

The engine needs only trio, attrs, cattrs and orjson. The client needs the ``client``
extra (httpx); the service and the ``trio-supervisor`` command need the ``service``
extra. A module of an optional part imports its third-party modules inside
:func:`needs_extra`, so that a missing one is reported with the pip command that
installs it, instead of a bare ``No module named 'httpx'``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["MissingExtraError", "needs_extra"]


class MissingExtraError(ModuleNotFoundError):
    """An optional part's module is not installed; the message says which extra brings it."""


@contextlib.contextmanager
def needs_extra(extra: str, what: str, *modules: str) -> Iterator[None]:
    """Turn the failed import of one of ``modules`` into an error naming ``extra``.

    Args:
        extra: The optional extra that installs the modules (``"client"``, ``"service"``).
        what: What needs them, for the message (``"trio_supervisor.client"``).
        modules: The top-level names of the modules the extra provides; an import error
            of any other module goes through unchanged.

    Raises:
        ModuleNotFoundError: One of ``modules`` is not installed (an ``ImportError``);
            its message ends with ``pip install 'trio_supervisor[<extra>]'``, and its
            ``name`` is the module's. A module that is installed but fails to import
            (too old a version, say) raises its own error unchanged.
    """
    try:
        yield
    except ModuleNotFoundError as error:
        missing = (error.name or "").partition(".")[0]
        if missing not in modules:
            raise
        raise MissingExtraError(
            f"{what} needs {missing}, which is not installed; it comes with the "
            f"[{extra}] extra: pip install 'trio_supervisor[{extra}]'",
            name=error.name,
        ) from error
