"""The documentation (README.md and the site under docs/) is checked against the tool.

The finding codes' tables on docs/codes.md are generated from the registry and must match it exactly.
Regenerate the table with:

    python -c "from ckptfix.checks import codes_table_markdown; print(codes_table_markdown())"

and paste it between the `<!-- codes:start -->` and `<!-- codes:end -->` markers in docs/codes.md. The guard's
table (CKF8xx, declared in ckptfix/checks/guard.py) likewise, from `guard_codes_table_markdown()`, between the
`<!-- guard-codes:start -->` and `<!-- guard-codes:end -->` markers of the same page.

Every code block of README.md and docs/*.md is checked: a block of `$ ckptfix ...` commands is run and must
print the lines shown (and the `(exit code N)` shown, else 0); the Python blocks are executed; the others are
compared with what the tool prints or run by the test named beside them (`test_every_code_block_is_checked`).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ckptfix.checks import SEVERITIES, codes_table_markdown, guard_codes_table_markdown, registry

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CODES = DOCS / "codes.md"
GETTING_STARTED = DOCS / "getting-started.md"
OBJECT_STORAGE = DOCS / "object-storage.md"  # its two blocks run in test_remote_read.py, test_object_store_in_place.py
START, END = "<!-- codes:start -->", "<!-- codes:end -->"
GUARD_START, GUARD_END = "<!-- guard-codes:start -->", "<!-- guard-codes:end -->"
README_MAX_LINES = 250


def documents() -> list[Path]:
    """README.md and every page of the site."""
    return [README, *sorted(DOCS.glob("*.md"))]


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


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


def test_codes_page_table_matches_the_registry():
    text = _text(CODES)
    assert text.count(START) == 1 and text.count(END) == 1, f"docs/codes.md needs one {START} ... {END} block"
    section = text.split(START, 1)[1].split(END, 1)[0]
    assert section.strip() == codes_table_markdown(), (
        "docs/codes.md's codes table is out of date; regenerate it with\n"
        "python -c \"from ckptfix.checks import codes_table_markdown; print(codes_table_markdown())\"")
    assert not any(START in _text(p) for p in documents() if p != CODES)  # one table, on one page


def test_guard_codes_and_the_guard_loop_are_documented():
    """The guard's CKF8xx codes and the codes page's guard table name the same codes, and the guard page's
    loop is the code tests/test_guard_readme_loop.py executes."""
    import test_guard_readme_loop

    table = _text(CODES).split(GUARD_START)[1].split(GUARD_END)[0]
    documented = set(re.findall(r"\| (CKF8\d\d) \|", table))
    source = "".join(p.read_text() for p in (ROOT / "ckptfix" / "guard").glob("*.py"))
    used = set(re.findall(r'"(CKF8\d\d)"', source))
    assert documented == used
    assert test_guard_readme_loop.README_LOOP.strip("\n") in _text(DOCS / "guard.md")


def test_guard_codes_table_matches_the_registry():
    """Both tables come from the one registry; the guard's exceptions are ckptfix errors."""
    from ckptfix.errors import CkptfixError
    from ckptfix.guard import ResumeError, TrainingSetupError

    section = _text(CODES).split(GUARD_START, 1)[1].split(GUARD_END, 1)[0]
    assert section.strip() == guard_codes_table_markdown(), (
        "docs/codes.md's guard codes table is out of date; regenerate it with\n"
        "python -c \"from ckptfix.checks import guard_codes_table_markdown; print(guard_codes_table_markdown())\"")
    guard, checkpoint = registry(guard=True), registry()
    assert guard and all(re.fullmatch(r"CKF8\d\d", c) for c in guard) and not set(guard) & set(checkpoint)
    assert issubclass(ResumeError, TrainingSetupError) and issubclass(TrainingSetupError, CkptfixError)
    assert issubclass(TrainingSetupError, RuntimeError)  # what it was before: `except RuntimeError` still works


# -- Every code block of the README and the site is checked against the tool (issues 33, 46) ---------------


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
    page shows (built as tests/test_weights_only.py builds it)."""
    import torch
    from test_weights_only import timm_args

    (tmp_path / "fixtures").symlink_to(ROOT / "fixtures")
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
    # an absolute path the output names (a record's tokenizer) is shown in the docs from /path/to/ckptfix
    out = res.stdout.replace(str(cwd), "/path/to/ckptfix").replace(str(ROOT), "/path/to/ckptfix")
    return out.rstrip("\n").split("\n"), res.returncode


def _shell_blocks(path: Path) -> list[str]:
    return [body for _, body in _code_blocks(_text(path)) if body.startswith("$ ")]


# The documents with `$ ckptfix` blocks, and the document whose commands a reader ran before (its files are
# what the later page's commands read: the worked example's ckpt.fixed.pth).
SHELL_DOCUMENTS = {"README.md": None, "getting-started.md": None, "weights-only.md": None,
                   "will-it-resume.md": None, "new-tokens.md": "getting-started.md"}


def _document(name: str) -> Path:
    return README if name == "README.md" else DOCS / name


def test_shell_documents_are_all_listed():
    assert {p.name for p in documents() if _shell_blocks(p)} == set(SHELL_DOCUMENTS)


@pytest.mark.parametrize("name", sorted(SHELL_DOCUMENTS))
def test_shell_examples_are_the_real_output(readme_dir, name):
    """Each `$ ckptfix ...` of the document is run, in order (after those of the page a reader ran before
    it), and its stdout and exit code are the lines the document shows."""
    before = SHELL_DOCUMENTS[name]
    for path in ([_document(before)] if before else []) + [_document(name)]:
        for body in _shell_blocks(path):
            for command, expected, code in _shell_sessions(body):
                lines, rc = _run(command, readme_dir)
                assert (lines, rc) == (expected, code), f"{path.name} drift for `{command}`:\n" + "\n".join(lines)


@pytest.mark.parametrize("path", [README, GETTING_STARTED], ids=lambda p: p.name)
def test_setup_commands_are_cis_and_run(path):
    """Set-up: the CPU-index line for readers, the pinned PyPI line CI uses (said in both places), the test
    command CI runs; the inspect command of the set-up block is the worked example's first command."""
    text = _text(path)
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    setup, tests = _code_blocks(text)[:2]
    assert setup[1].splitlines()[0] == "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert "python -m pip install --quiet torch==2.13.0" in ci.splitlines() and "`pip install torch==2.13.0`" in text
    assert "download.pytorch.org/whl/cpu" in ci  # .ci/run's comment says why it does not use the CPU index
    assert tests[1].splitlines()[-1] == "python -m pytest -q" and "python -m pytest -q" in ci.splitlines()
    inspect_line = setup[1].splitlines()[1].split(" && ", 1)[1]
    worked = next(body for _, body in _code_blocks(text) if body.startswith("$ "))
    assert _shell_sessions(worked)[0][0] == inspect_line


def test_resume_excerpt_is_what_repair_prints():
    from ckptfix.render import _line
    from ckptfix.resume_hints import resume_lines

    excerpt = next(body for _, body in _code_blocks(_text(DOCS / "resume-new-tokens.md"))
                   if body.startswith("wrote out-checkpoint-30-fixed"))
    assert excerpt.splitlines() == ["wrote out-checkpoint-30-fixed",
                                    _line("resume", resume_lines("hf-trainer", "out-checkpoint-30-fixed", 519, 519)[0])]


def _python_api_blocks() -> list[tuple[Path, str]]:
    return [(p, b) for p in documents() for info, b in _code_blocks(_text(p))
            if info == "python" and "ckptfix.inspect(" in b]


@pytest.mark.parametrize("path, body", _python_api_blocks(), ids=lambda x: x.name if isinstance(x, Path) else "")
def test_python_api_blocks_run(readme_dir, monkeypatch, path, body):
    """The Python API blocks (README's short one, the API page's), executed with a real model, optimizer,
    scaler and scheduler; each name has the type its comment says."""
    import torch

    import ckptfix
    from ckptfix.checkpoint import Checkpoint
    from ckptfix.guard.problems import Problem

    monkeypatch.chdir(readme_dir)
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 8), torch.nn.Linear(8, 1000))
    optimizer = torch.optim.AdamW(model.parameters())
    namespace = {"model": model, "optimizer": optimizer, "scaler": torch.amp.GradScaler("cpu"),
                 "scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)}
    exec(compile(body, str(path.relative_to(ROOT)), "exec"), namespace)
    expected = {"report": ckptfix.Report, "result": ckptfix.RepairResult, "ckpt": Checkpoint,
                "tok": ckptfix.TokenizerInfo, "delta": ckptfix.DiffReport, "done": ckptfix.ConvertResult,
                "guard": ckptfix.ResumeGuard}
    for name, cls in expected.items():
        if f"{name} = " in body:
            assert isinstance(namespace[name], cls), name
    assert namespace["report"].exit_code == 1
    assert all(isinstance(p, Problem) for p in namespace.get("problems", []))


def test_python_api_blocks_are_readmes_and_the_api_pages():
    assert sorted(p.name for p, _ in _python_api_blocks()) == ["README.md", "api.md"]


WRITE_BLOCK = "ckptfix repair s3://bucket/run/step-100/ -t tok.model -o s3://"


def test_every_code_block_is_checked():
    """A new block must join one of the tests above (or the guard loop's, or the object-storage tests')."""
    import test_guard_readme_loop

    unchecked, storage = [], []
    for path in documents():
        for _, b in _code_blocks(_text(path)):
            if "ckptfix[s3]" in b or b.startswith(WRITE_BLOCK):
                storage.append(path)  # run by tests/test_remote_read.py and tests/test_object_store_in_place.py
            elif not (b.startswith(("$ ", "pip install", "wrote out-checkpoint-30-fixed")) or "ckptfix.inspect(" in b
                      or b.strip("\n") == test_guard_readme_loop.README_LOOP.strip("\n")):
                unchecked.append((path.name, b[:80]))
    assert not unchecked
    assert storage == [OBJECT_STORAGE, OBJECT_STORAGE]


# -- README's size, the links, the site's build (issue 46) ------------------------------------------------


def test_readme_is_short():
    assert len(_text(README).splitlines()) <= README_MAX_LINES


def _slugs(text: str) -> set[str]:
    """Heading anchors as both GitHub and mkdocs (Python-Markdown's toc) make them; a link must work on both."""
    github, mkdocs = set(), set()
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S), flags=re.M):
        plain = heading.replace("`", "").strip().lower()
        github.add(re.sub(r"[^\w\- ]", "", plain).replace(" ", "-"))
        mkdocs.add(re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", plain)).strip("-"))
    return github & mkdocs


def test_every_relative_link_resolves():
    """Every relative link of README.md and docs/*.md names a file that exists, and its #anchor a heading there."""
    broken = []
    for path in documents():
        text = re.sub(r"^```.*?^```$", "", _text(path), flags=re.M | re.S)
        text = re.sub(r"`[^`\n]*`", "", text)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.name}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _slugs(_text(dest)):
                broken.append(f"{path.name}: {target} (no such heading)")
    assert not broken


def _hooks():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ckptfix_docs_hooks", DOCS / "hooks.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_site_hooks_generate_the_cli_api_and_security_pages():
    """What docs/hooks.py adds when the site is built: every command's help (click's own), every public name
    (mkdocstrings directives), SECURITY.md."""
    import click

    import ckptfix
    from ckptfix.cli import cli

    hooks = _hooks()
    names = cli.list_commands(click.Context(cli))
    cli_page = hooks.page_markdown(_text(DOCS / "cli.md"), "cli.md")
    assert hooks.CLI_MARKER not in cli_page and names
    for name in names:
        assert f"Usage: ckptfix {name} [OPTIONS]" in cli_page, name
    api_page = hooks.page_markdown(_text(DOCS / "api.md"), "api.md")
    assert [f"::: ckptfix.{n}" for n in ckptfix.__all__ if n != "__version__"] == re.findall(r"^::: .*$", api_page, flags=re.M)
    security = hooks.page_markdown(_text(DOCS / "security.md"), "security.md")
    assert hooks.SECURITY_MARKER not in security and "](security.md)" in security
    assert re.search(r"^### What ckptfix promises when it reads$", security, flags=re.M)  # one level down
    assert not re.search(r"^## What ckptfix promises", security, flags=re.M)


def test_ci_builds_the_site_strictly():
    """.ci/run installs the docs extra and builds the site with --strict; the extra pins what it installs."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert any(line.startswith("python -m pip install") and ".[docs]" in line for line in ci)
    assert any("mkdocs build --strict" in line and not line.startswith("#") for line in ci)
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["docs"]
    assert "mkdocs==1.6.1" in extra and all("==" in req for req in extra), extra


def test_site_builds(tmp_path):
    """The build CI runs, here too where the docs extra is installed."""
    import os
    import subprocess
    import sys

    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "codes" / "index.html").is_file()
