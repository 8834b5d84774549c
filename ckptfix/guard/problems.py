"""Findings of the training guard: `Problem`, the error/warning types, and how they are reported."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ckptfix.errors import CkptfixError

__all__ = ["Problem", "TrainingSetupError", "TrainingSetupWarning", "format_names", "MAX_NAMES"]

#: How many parameter names a message lists before "and N more".
MAX_NAMES = 10


@dataclass(frozen=True)
class Problem:
    """One finding. `params` names the parameters concerned (may be empty)."""

    code: str  # "CKF8xx"
    severity: str  # "error", "warning" or "info" (what will happen, nothing wrong: logged, never warned)
    message: str
    params: tuple[str, ...] = ()

    def __str__(self) -> str:
        line = f"{self.code} {self.severity}: {self.message}"
        if self.params:
            line += f" [{format_names(self.params)}]"
        return line


def format_names(names: Sequence[str], limit: int = MAX_NAMES) -> str:
    """`a, b, c and 7 more`: keep messages readable for models with thousands of parameters."""
    shown = ", ".join(names[:limit])
    rest = len(names) - limit
    return f"{shown} and {rest} more" if rest > 0 else shown


class TrainingSetupError(CkptfixError, RuntimeError):
    """Raised when training, as set up, would run without learning. `.problems` lists why.
    A `CkptfixError` (one `except` catches everything ckptfix raises) and, as before, a RuntimeError."""

    def __init__(self, problems: Sequence[Problem]):
        self.problems = list(problems)
        errors = sum(p.severity == "error" for p in self.problems)
        warns = sum(p.severity == "warning" for p in self.problems)
        summary = f"training would not learn: {errors} error(s), {warns} warning(s)"
        super().__init__("\n".join([summary, *(f"  {p}" for p in self.problems)]))


class TrainingSetupWarning(UserWarning):
    """Warning-level findings, emitted through `warnings.warn` in guard mode."""


def raise_or_warn(problems: Sequence[Problem], error: Callable[[list[Problem]], Exception],
                  stacklevel: int = 3) -> None:
    """The guard's one ending: raise `error(problems)` if any is an error, else `warnings.warn` each
    warning and log each info.
    `stacklevel` 3 points the warning at the caller of the function that calls this."""
    if any(p.severity == "error" for p in problems):
        raise error(list(problems))
    for problem in problems:
        if problem.severity == "info":  # not a warning: logged (logger "ckptfix"), and returned by the guard
            logging.getLogger("ckptfix").info("%s", problem)
        else:
            warnings.warn(str(problem), TrainingSetupWarning, stacklevel=stacklevel)


def report_problems(problems: list[Problem], raise_on_error: bool, stacklevel: int = 3) -> list[Problem]:
    """Guard mode (`raise_on_error`): raise on errors, `warnings.warn` the warnings.

    Report mode: return everything and have no side effects.
    """
    if raise_on_error:
        raise_or_warn(problems, TrainingSetupError, stacklevel + 1)
    return problems
