"""Findings: each code is one small function registered here, with its severity and one line of docs.

The README's table of codes is generated from `REGISTRY` (and a test checks they agree), so the
docs cannot drift from the code. Check functions take the `Context` and yield `Finding`s.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from ckptfix.checkpoint import Checkpoint
from ckptfix.mapping import ParamMapping

SEVERITIES = ("error", "warning", "info")


@dataclass
class Finding:
    code: str
    severity: str
    title: str
    message: str  # what is wrong, with the numbers
    pytorch: str = ""  # what PyTorch will really do with this checkpoint
    fix: str = ""  # the exact fix, usually a command line
    tensors: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code, "severity": self.severity, "title": self.title, "message": self.message,
                "pytorch": self.pytorch, "fix": self.fix, "tensors": self.tensors}


@dataclass
class Context:
    """Everything a check may look at. `scan` says whether tensor bytes may be read."""

    ckpt: Checkpoint
    mapping: ParamMapping
    vocab: list  # list[VocabTensor]
    tokenizer: Any = None  # TokenizerInfo or None
    scan: bool = False
    verify: bool = False
    progress: Callable[[Iterable, int, str], Iterable] | None = None
    old_tokenizer: Any = None  # identity.OldTokenizer: the tokenizer the rows belong to, when known

    def repair_command(self, *extra: str) -> str:
        """The `ckptfix repair` line that fixes this checkpoint, with a sensible output path, quoted for a
        POSIX shell (a path with a space or a quote pastes as one argument)."""
        src = self.ckpt.path.rstrip("/") or self.ckpt.path
        root, ext = os.path.splitext(src)
        out = f"{src}-fixed" if os.path.isdir(src) else f"{root}.fixed{ext}"
        words = ["ckptfix", "repair", src, "--tokenizer",
                 self.tokenizer.path if self.tokenizer is not None else "NEW_TOKENIZER"]
        if self.old_tokenizer is not None and self.old_tokenizer.origin == "given":
            words += ["--from-tokenizer", self.old_tokenizer.path]
        words += ["-o", out]
        return " ".join([*map(shlex.quote, words), *extra])


@dataclass(frozen=True)
class Check:
    code: str
    severity: str  # the most severe level this code reports
    title: str
    doc: str
    func: Callable[[Context], Iterator[Finding]]


REGISTRY: dict[str, Check] = {}


def check(code: str, severity: str, title: str, doc: str):
    """Register a check function under a stable code."""
    def wrap(func: Callable[[Context], Iterator[Finding]]):
        if code in REGISTRY:
            raise ValueError(f"duplicate finding code {code}")
        REGISTRY[code] = Check(code, severity, title, doc, func)
        return func
    return wrap


def finding(code: str, message: str, *, severity: str | None = None, pytorch: str = "", fix: str = "",
            tensors: Iterable[str] = ()) -> Finding:
    spec = REGISTRY[code]
    return Finding(code, severity or spec.severity, spec.title, message, pytorch, fix, list(tensors))


def run_checks(ctx: Context) -> list[Finding]:
    _load_check_modules()
    findings: list[Finding] = []
    for spec in sorted(REGISTRY.values(), key=lambda c: c.code):
        findings.extend(spec.func(ctx))
    order = {s: i for i, s in enumerate(SEVERITIES)}
    return sorted(findings, key=lambda f: (order[f.severity], f.code))


def _load_check_modules() -> None:
    from ckptfix.checks import adapters, identity, integrity, numerics, optimizer, scaler, schedule, sharded, vocab  # noqa: F401


def registry() -> dict[str, Check]:
    _load_check_modules()
    return dict(sorted(REGISTRY.items()))


def codes_table_markdown() -> str:
    """The README's table of finding codes, generated from the registry (tests/test_docs.py checks they agree).

    One row per code: | code | severity | title | what it means |. Pipes in the text are escaped.
    """
    def cell(text: str) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")

    lines = ["| code | severity | title | what it means |", "| --- | --- | --- | --- |"]
    for spec in registry().values():
        lines.append(f"| {spec.code} | {spec.severity} | {cell(spec.title)} | {cell(spec.doc)} |")
    return "\n".join(lines)
