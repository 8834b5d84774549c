"""Damage a resume file the ways a crash or a bad copy does (the resume-completeness tests, issue 42)."""

from __future__ import annotations

from pathlib import Path

HOWS = ("removed", "half", "zero")


def cut(data: bytes, how: str) -> bytes:
    """The bytes a save cut short leaves: the first half ("half") or nothing ("zero")."""
    return data[: len(data) // 2] if how == "half" else b""


def damage(path: Path, how: str) -> None:
    """`path` removed, or cut in place (`cut`)."""
    if how == "removed":
        path.unlink()
    else:
        path.write_bytes(cut(path.read_bytes(), how))
