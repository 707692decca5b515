"""The `tecc` command (filled in by the CLI work)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    print("tecc: the command line is not built yet")
    return 1
