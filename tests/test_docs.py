"""The README's table of finding codes is generated from the registry and must match it exactly.

Regenerate the table with:

    python -c "from ckptfix.checks import codes_table_markdown; print(codes_table_markdown())"

and paste it between the `<!-- codes:start -->` and `<!-- codes:end -->` markers in README.md. The guard's
table (CKF8xx, declared in ckptfix/checks/guard.py) likewise, from `guard_codes_table_markdown()`, between the
`<!-- guard-codes:start -->` and `<!-- guard-codes:end -->` markers.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ckptfix.checks import SEVERITIES, codes_table_markdown, guard_codes_table_markdown, registry

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- codes:start -->", "<!-- codes:end -->"


def test_codes_table_has_one_row_per_registered_code():
    lines = codes_table_markdown().splitlines()
    assert lines[0] == "| code | severity | title | what it means |"
    assert lines[1] == "| --- | --- | --- | --- |"
    rows = lines[2:]
    specs = list(registry().values())
    assert len(rows) == len(specs)
    for row, spec in zip(rows, specs):
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
        assert cells[:3] == [spec.code, spec.severity, spec.title]
        assert cells[3].replace("\\|", "|") == " ".join(spec.doc.split())
        assert spec.severity in SEVERITIES and re.fullmatch(r"CKF\d{3}", spec.code)
    assert [s.code for s in specs] == sorted(s.code for s in specs)


def test_readme_codes_table_matches_the_registry():
    if not README.exists():
        pytest.skip("README.md does not exist yet; its codes table is checked once it does")
    text = README.read_text(encoding="utf-8")
    assert text.count(START) == 1 and text.count(END) == 1, f"README.md needs one {START} ... {END} block"
    section = text.split(START, 1)[1].split(END, 1)[0]
    if not section.strip():
        pytest.skip("README.md's codes block is still empty: paste the output of codes_table_markdown() into it")
    assert section.strip() == codes_table_markdown(), (
        "README.md's codes table is out of date; regenerate it with\n"
        "python -c \"from ckptfix.checks import codes_table_markdown; print(codes_table_markdown())\"")


def test_readme_lists_every_guard_code_and_the_guard_loop():
    """The guard's CKF8xx codes and the README's guard table name the same codes, and the README's loop
    is the code tests/test_guard_readme_loop.py executes."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    table = readme.split("<!-- guard-codes:start -->")[1].split("<!-- guard-codes:end -->")[0]
    documented = set(re.findall(r"\| (CKF8\d\d) \|", table))
    source = "".join(p.read_text() for p in (root / "ckptfix" / "guard").glob("*.py"))
    used = set(re.findall(r'"(CKF8\d\d)"', source))
    assert documented == used
    import test_guard_readme_loop

    assert test_guard_readme_loop.README_LOOP.strip("\n") in readme


def test_readme_guard_codes_table_matches_the_registry():
    """Both README tables come from the one registry; the guard's exceptions are ckptfix errors."""
    from ckptfix.errors import CkptfixError
    from ckptfix.guard import ResumeError, TrainingSetupError

    text = README.read_text(encoding="utf-8")
    section = text.split("<!-- guard-codes:start -->", 1)[1].split("<!-- guard-codes:end -->", 1)[0]
    assert section.strip() == guard_codes_table_markdown(), (
        "README.md's guard codes table is out of date; regenerate it with\n"
        "python -c \"from ckptfix.checks import guard_codes_table_markdown; print(guard_codes_table_markdown())\"")
    guard, checkpoint = registry(guard=True), registry()
    assert guard and all(re.fullmatch(r"CKF8\d\d", c) for c in guard) and not set(guard) & set(checkpoint)
    assert issubclass(ResumeError, TrainingSetupError) and issubclass(TrainingSetupError, CkptfixError)
    assert issubclass(TrainingSetupError, RuntimeError)  # what it was before: `except RuntimeError` still works
