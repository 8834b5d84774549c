"""The registry of finding codes (`REGISTRY`): each code once, with its severity, title and one line of docs, and the
`Finding`s and `Context` the checks share.

Its own module so that the check modules register themselves here while the package (`checks/__init__.py`,
which runs them and generates the README tables) imports them, with no import going back up.
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
    resume: Any = None  # data_position.ResumeWith: the settings a resume will use (CKF314), when given

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
        why = ""
        if self.old_tokenizer is not None and self.old_tokenizer.origin == "given":
            words += ["--from-tokenizer", self.old_tokenizer.path]
        elif "--from-tokenizer" not in extra and self._ids_unchecked():
            words += ["--from-tokenizer", "OLD_TOKENIZER"]
            why = ("  (OLD_TOKENIZER: the tokenizer the checkpoint was trained with; leave --from-tokenizer out only "
                   "if the new one kept its ids and appended tokens: rows are then kept by id)")
        words += ["-o", out]
        return " ".join([*map(shlex.quote, words), *extra]) + why

    def _ids_unchecked(self) -> bool:
        from ckptfix.identity import ids_unchecked
        from ckptfix.vocab import vocab_rows

        return ids_unchecked(self.ckpt, self.tokenizer, self.old_tokenizer, vocab_rows(self.vocab))


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
