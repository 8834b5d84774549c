"""Findings: each code is registered here once, with its severity, title and one line of docs.

Checkpoint codes (CKF1xx-7xx) are one small function each (`@check`): it takes the `Context` and
yields `Finding`s. The training guard's codes (CKF8xx, `checks/guard.py`) are declarations
(`declare`): the guard makes their `Problem`s from live torch objects. Both README tables are
generated from `REGISTRY` (`codes_table_markdown`, `guard_codes_table_markdown`; tests/test_docs.py
checks they agree), so the docs cannot drift from the code.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from ckptfix.checkpoint import Checkpoint
from ckptfix.mapping import ParamMapping
from ckptfix.optim_state import refusals

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
        POSIX shell (a path with a space or a quote pastes as one argument). Where repair would refuse the
        checkpoint, the reason instead: inspect never prints a command that then fails."""
        from ckptfix.blockers import repair_blocker

        blocked = repair_blocker(self.ckpt, self.vocab)
        if blocked:
            return f"ckptfix repair cannot fix this: {blocked}."
        if not {"--policy fresh", "--policy reset"} & set(extra) and refusals(self.ckpt.optimizer, self.vocab):
            extra = (*[e for e in extra if not e.startswith("--policy")], "--policy fresh")  # CKF210 says why
        from ckptfix.resume_hints import repair_target, suggested_output

        src, _ = repair_target(self.ckpt.path.rstrip("/") or self.ckpt.path)  # never half a checkpoint folder
        out = suggested_output(src)
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
    func: Callable[[Context], Iterator[Finding]] | None  # None: a guard code (declared, made by the guard)

    @property
    def is_guard(self) -> bool:
        return self.func is None and self.code.startswith("CKF8")


REGISTRY: dict[str, Check] = {}


def _register(spec: Check) -> None:
    if spec.code in REGISTRY:
        raise ValueError(f"duplicate finding code {spec.code}")
    if spec.severity not in SEVERITIES:
        raise ValueError(f"{spec.code}: unknown severity {spec.severity!r}")
    REGISTRY[spec.code] = spec


def check(code: str, severity: str, title: str, doc: str):
    """Register a check function under a stable code."""
    def wrap(func: Callable[[Context], Iterator[Finding]]):
        _register(Check(code, severity, title, doc, func))
        return func
    return wrap


def declare(code: str, severity: str, title: str, doc: str) -> None:
    """Register a code whose findings are made outside `run_checks`: the guard's CKF8xx (its `Problem`s),
    the audit's CKF13x (`ckptfix.audit`, after the plan); the registry documents it."""
    _register(Check(code, severity, title, doc, None))


def finding(code: str, message: str, *, severity: str | None = None, pytorch: str = "", fix: str = "",
            tensors: Iterable[str] = ()) -> Finding:
    spec = REGISTRY[code]
    return Finding(code, severity or spec.severity, spec.title, message, pytorch, fix, list(tensors))


def run_checks(ctx: Context) -> list[Finding]:
    _load_check_modules()
    findings: list[Finding] = []
    for spec in sorted(REGISTRY.values(), key=lambda c: c.code):
        if spec.func is not None:
            findings.extend(spec.func(ctx))
    order = {s: i for i, s in enumerate(SEVERITIES)}
    return sorted(findings, key=lambda f: (order[f.severity], f.code))


def _load_check_modules() -> None:
    from ckptfix.checks import (  # noqa: F401
        adapters,
        audit,
        guard,
        identity,
        integrity,
        megatron,
        numerics,
        optimizer,
        recorded,
        reserved,
        scaler,
        schedule,
        sharded,
        vocab,
        weights_only,
    )


def registry(*, guard: bool = False) -> dict[str, Check]:
    """The checkpoint codes (`inspect`), or with `guard` the training guard's codes, by code."""
    _load_check_modules()
    return {code: spec for code, spec in sorted(REGISTRY.items()) if spec.is_guard == guard}


def _table(specs: Iterable[Check]) -> str:
    def cell(text: str) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")

    lines = ["| code | severity | title | what it means |", "| --- | --- | --- | --- |"]
    for spec in specs:
        lines.append(f"| {spec.code} | {spec.severity} | {cell(spec.title)} | {cell(spec.doc)} |")
    return "\n".join(lines)


def codes_table_markdown() -> str:
    """The README's table of finding codes, generated from the registry (tests/test_docs.py checks they agree).

    One row per code: | code | severity | title | what it means |. Pipes in the text are escaped.
    """
    return _table(registry().values())


def guard_codes_table_markdown() -> str:
    """The README's table of the guard's codes (CKF8xx), in the same shape as `codes_table_markdown`."""
    return _table(registry(guard=True).values())
