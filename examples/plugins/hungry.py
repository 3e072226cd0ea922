"""Allocates memory until its memory limit stops it (MemoryError, exit code 1)."""

from __future__ import annotations

from typing import Any


def main(context: Any) -> None:
    hoard = []
    while True:
        hoard.append(bytearray(16 * 1024 * 1024))
        print(f"holding {16 * len(hoard)} MiB", flush=True)
