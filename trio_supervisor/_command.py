"""The ``trio-supervisor`` command's entry point: the CLI (``cli.py``) when the
``[service]`` extra is installed, else one line saying how to install it (exit status 1),
instead of a chained traceback."""

from __future__ import annotations

import sys

from ._extras import MissingExtraError

__all__ = ["main"]


def main() -> None:
    """Run ``trio-supervisor``."""
    try:
        from .cli import main as command
    except MissingExtraError as error:
        print(f"Error: {error}", file=sys.stderr)
        sys.exit(1)
    command()
