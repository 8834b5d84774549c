"""Findings: each code is registered once, with its severity, title and one line of docs (`checks/codes.py`).

Checkpoint codes (CKF1xx-7xx) are one small function each (`@check`): it takes the `Context` and
yields `Finding`s. The training guard's codes (CKF8xx, `checks/guard.py`) are declarations
(`declare`): the guard makes their `Problem`s from live torch objects. Both README tables are
generated from `REGISTRY` (`codes_table_markdown`, `guard_codes_table_markdown`; tests/test_docs.py
checks they agree), so the docs cannot drift from the code. This package imports every check module (each
registers its codes on import) and runs them; the modules import only `checks.codes`.
"""

from __future__ import annotations

from typing import Iterable

# each check module registers its codes when imported
import ckptfix.checks.adapters  # noqa: F401
import ckptfix.checks.audit  # noqa: F401
import ckptfix.checks.data_position  # noqa: F401
import ckptfix.checks.guard  # noqa: F401
import ckptfix.checks.identity  # noqa: F401
import ckptfix.checks.integrity  # noqa: F401
import ckptfix.checks.megatron  # noqa: F401
import ckptfix.checks.numerics  # noqa: F401
import ckptfix.checks.optimizer  # noqa: F401
import ckptfix.checks.recorded  # noqa: F401
import ckptfix.checks.reserved  # noqa: F401
import ckptfix.checks.resume  # noqa: F401
import ckptfix.checks.resume_accelerate  # noqa: F401
import ckptfix.checks.resume_deepspeed  # noqa: F401
import ckptfix.checks.resume_hf_model  # noqa: F401
import ckptfix.checks.resume_lightning  # noqa: F401
import ckptfix.checks.resume_torch  # noqa: F401
import ckptfix.checks.scaler  # noqa: F401
import ckptfix.checks.schedule  # noqa: F401
import ckptfix.checks.sharded  # noqa: F401
import ckptfix.checks.vocab  # noqa: F401
import ckptfix.checks.weights_only  # noqa: F401
from ckptfix.checks.codes import (  # noqa: F401 (the registry's names, re-exported for inspect and the CLI)
    REGISTRY,
    SEVERITIES,
    Check,
    Context,
    Finding,
    check,
    declare,
    finding,
)


def run_checks(ctx: Context) -> list[Finding]:
    findings: list[Finding] = []
    for spec in sorted(REGISTRY.values(), key=lambda c: c.code):
        if spec.func is not None:
            findings.extend(spec.func(ctx))
    order = {s: i for i, s in enumerate(SEVERITIES)}
    return sorted(findings, key=lambda f: (order[f.severity], f.code))


def registry(*, guard: bool = False) -> dict[str, Check]:
    """The checkpoint codes (`inspect`), or with `guard` the training guard's codes, by code."""
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
