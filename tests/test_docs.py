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


# -- Every code block of the README is checked against the tool (issue 33) ----------------------------------


def _code_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of each fenced block, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```$", text, flags=re.M | re.S)


def _shell_sessions(body: str) -> list[tuple[str, list[str], int]]:
    """(command, expected stdout lines, expected exit code) for each `$ ` command of a block."""
    sessions = []
    for chunk in re.split(r"^\$ ", body, flags=re.M)[1:]:
        command, *lines = chunk.rstrip("\n").split("\n")
        while lines and not lines[-1]:
            lines.pop()
        code = 0
        if lines and (m := re.fullmatch(r"\(exit code (\d+)\)", lines[-1])):
            code = int(m.group(1))
            lines.pop()
        sessions.append((command, lines, code))
    return sessions


@pytest.fixture
def readme_dir(tmp_path):
    """A folder as a reader's checkout: `fixtures/` (linked), and the timm-style `last.pth.tar` the weights-only
    section shows (built as tests/test_weights_only.py builds it)."""
    import torch
    from test_weights_only import timm_args

    (tmp_path / "fixtures").symlink_to(README.parent / "fixtures")
    torch.save({"epoch": 3, "arch": "resnet18", "state_dict": {"fc.weight": torch.zeros(2, 2)}, "args": timm_args()},
               tmp_path / "last.pth.tar")
    return tmp_path


def _run(command: str, cwd: Path) -> tuple[list[str], int]:
    import os
    import shlex
    import subprocess
    import sys

    words = shlex.split(command)
    assert words[0] == "ckptfix", command
    env = {**os.environ, "NO_COLOR": "1"}
    res = subprocess.run([sys.executable, "-m", "ckptfix", *words[1:]], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=300)
    # an absolute path the output names (a record's tokenizer) is shown in the README from /path/to/ckptfix
    out = res.stdout.replace(str(cwd), "/path/to/ckptfix").replace(str(README.parent), "/path/to/ckptfix")
    return out.rstrip("\n").split("\n"), res.returncode


def test_readme_shell_examples_are_the_real_output(readme_dir):
    """The worked example and the weights-only example: each `$ ckptfix ...` is run, in order, and its
    stdout and exit code are the lines the README shows."""
    blocks = [body for _, body in _code_blocks(README.read_text(encoding="utf-8")) if body.startswith("$ ")]
    assert len(blocks) == 2
    for body in blocks:
        for command, expected, code in _shell_sessions(body):
            lines, rc = _run(command, readme_dir)
            assert (lines, rc) == (expected, code), f"README drift for `{command}`:\n" + "\n".join(lines)


def test_readme_setup_commands_are_cis_and_run(readme_dir):
    """Set-up: the CPU-index line for readers, the pinned PyPI line CI uses (said in both places), the test
    command CI runs; the inspect command of the set-up block is the worked example's first command."""
    text = README.read_text(encoding="utf-8")
    ci = (README.parent / ".ci" / "run").read_text(encoding="utf-8")
    setup, tests = _code_blocks(text)[:2]
    assert setup[1].splitlines()[0] == "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert "python -m pip install --quiet torch==2.13.0" in ci.splitlines() and "`pip install torch==2.13.0`" in text
    assert "download.pytorch.org/whl/cpu" in ci  # .ci/run's comment says why it does not use the CPU index
    assert tests[1].splitlines()[-1] == "python -m pytest -q" and "python -m pytest -q" in ci.splitlines()
    inspect_line = setup[1].splitlines()[1].split(" && ", 1)[1]
    worked = next(body for _, body in _code_blocks(text) if body.startswith("$ "))
    assert _shell_sessions(worked)[0][0] == inspect_line


def test_readme_resume_excerpt_is_what_repair_prints():
    from ckptfix.render import _line
    from ckptfix.resume_hints import resume_lines

    excerpt = next(body for _, body in _code_blocks(README.read_text(encoding="utf-8"))
                   if body.startswith("wrote out-checkpoint-30-fixed"))
    assert excerpt.splitlines() == ["wrote out-checkpoint-30-fixed",
                                    _line("resume", resume_lines("hf-trainer", "out-checkpoint-30-fixed", 519, 519)[0])]


def test_readme_python_api_block_runs(readme_dir, monkeypatch):
    """The Python API block, executed with a real model, optimizer, scaler and scheduler; each name has the
    type its comment says."""
    import torch

    import ckptfix
    from ckptfix.checkpoint import Checkpoint
    from ckptfix.guard.problems import Problem

    text = README.read_text(encoding="utf-8")
    (body,) = [b for info, b in _code_blocks(text) if info == "python" and "ckptfix.inspect(" in b]
    monkeypatch.chdir(readme_dir)
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 8), torch.nn.Linear(8, 1000))
    optimizer = torch.optim.AdamW(model.parameters())
    namespace = {"model": model, "optimizer": optimizer, "scaler": torch.amp.GradScaler("cpu"),
                 "scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)}
    exec(compile(body, "README.md", "exec"), namespace)
    expected = {"report": ckptfix.Report, "result": ckptfix.RepairResult, "ckpt": Checkpoint,
                "tok": ckptfix.TokenizerInfo, "delta": ckptfix.DiffReport, "done": ckptfix.ConvertResult,
                "guard": ckptfix.ResumeGuard}
    for name, cls in expected.items():
        assert isinstance(namespace[name], cls), name
    assert namespace["report"].exit_code == 1
    assert all(isinstance(p, Problem) for p in namespace["problems"])


def test_every_readme_code_block_is_checked():
    """A new block must join one of the tests above (or the guard loop's)."""
    import test_guard_readme_loop

    bodies = [b for _, b in _code_blocks(README.read_text(encoding="utf-8"))]
    checked = [b for b in bodies if b.startswith(("$ ", "pip install", "wrote out-checkpoint-30-fixed"))
               or "ckptfix.inspect(" in b or b.strip("\n") == test_guard_readme_loop.README_LOOP.strip("\n")
               or b.startswith(WRITE_BLOCK)]
    # 8: the object-storage block (`pip install 'ckptfix[s3]'` ...) runs in tests/test_remote_read.py;
    # 9: the repair-into-object-storage block runs in tests/test_object_store_in_place.py
    assert len(checked) == len(bodies) == 9


WRITE_BLOCK = "ckptfix repair s3://bucket/run/step-100/ -t tok.model -o s3://"
