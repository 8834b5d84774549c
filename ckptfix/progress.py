"""Progress of long byte-bound work (repair, diff, `inspect --scan`/`--verify`) on a terminal.

The library takes a `Progress`: a callable `progress(items, total_bytes, label) -> items` that yields
the items back and counts each one's `nbytes` (or `file_size`) once it is done. `terminal_progress`
is the CLI's: it draws nothing unless stderr is a terminal, and nothing for work that ends within
`DELAY` seconds; then one line, redrawn at most ten times a second:

    repair  [##########..........]  1.21 GB / 2.40 GB  50%  ETA 0:00:07
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Iterable, Iterator, TextIO

Progress = Callable[[Iterable[Any], int, str], Iterable[Any]]

DELAY = 1.0  # seconds of work before a bar appears
WIDTH = 24


def item_bytes(item: Any) -> int:
    return int(getattr(item, "nbytes", 0) or getattr(item, "file_size", 0) or 0)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"  # pragma: no cover - the loop returns at GB


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Bar:
    """One progress line on `stream`, drawn only after `delay` seconds."""

    def __init__(self, total: int, label: str, stream: TextIO, delay: float | None = None):
        self.total, self.label, self.stream = max(total, 0), label, stream
        self.delay = DELAY if delay is None else delay
        self.done = 0
        self.start = time.monotonic()
        self._drawn_at: float | None = None

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if now - self.start < self.delay:
            return
        if self._drawn_at is None or now - self._drawn_at >= 0.1 or self.done >= self.total:
            self._draw(now)

    def _draw(self, now: float) -> None:
        self._drawn_at = now
        frac = min(1.0, self.done / self.total) if self.total else 1.0
        filled = int(frac * WIDTH)
        elapsed = now - self.start
        eta = elapsed * (1 - frac) / frac if frac > 0 else 0.0
        line = (f"{self.label:<7} [{'#' * filled}{'.' * (WIDTH - filled)}]  {human_bytes(self.done)} / "
                f"{human_bytes(self.total)}  {frac:4.0%}  ETA {_clock(eta)}")
        self.stream.write("\r" + line)
        self.stream.flush()

    def close(self) -> None:
        if self._drawn_at is not None:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()


def terminal_progress(quiet: bool = False, stream: TextIO | None = None) -> Progress | None:
    """The CLI's progress: None (no bar) with `quiet` or when `stream` (stderr) is not a terminal."""
    out = stream if stream is not None else sys.stderr
    if quiet or not out.isatty():
        return None

    def progress(items: Iterable[Any], total_bytes: int, label: str) -> Iterator[Any]:
        bar = Bar(total_bytes, label, out)
        try:
            for item in items:
                yield item
                bar.advance(item_bytes(item))
        finally:
            bar.close()

    return progress
