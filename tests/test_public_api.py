"""Issue 33, item 8: the public names of `ckptfix` are typed for mypy and IDEs while `import ckptfix` stays
cheap (no numpy, no torch, no click), and `ResumeError` is one of them.

`ckptfix/__init__.py` lists each lazily imported name twice: in `TYPE_CHECKING` imports (what type checkers
read) and in `_LAZY` (what the interpreter imports on first use). The tests check that the two agree, that
every name resolves to the object its module defines, and that `mypy --strict` on a user script sees real
types: a wrong argument type is an error, an unknown name too.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from importlib import import_module
from pathlib import Path

import pytest

import ckptfix

ROOT = Path(__file__).resolve().parents[1]


def test_the_typed_imports_and_the_lazy_table_agree():
    tree = ast.parse((ROOT / "ckptfix" / "__init__.py").read_text())
    typed = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                if isinstance(imp, ast.ImportFrom) and imp.module != "ckptfix":
                    typed.update({a.asname or a.name: imp.module for a in imp.names})
    assert typed == ckptfix._LAZY
    for name, module in ckptfix._LAZY.items():
        assert getattr(ckptfix, name) is getattr(import_module(module), name), name
    assert set(ckptfix._LAZY) <= set(ckptfix.__all__)


def test_resume_error_is_public_and_a_ckptfix_error():
    from ckptfix.guard.resume import ResumeError

    assert ckptfix.ResumeError is ResumeError and issubclass(ckptfix.ResumeError, ckptfix.CkptfixError)


def test_import_ckptfix_and_version_stay_light():
    code = ("import sys, ckptfix; ckptfix.__version__; "
            "print(sorted(m for m in ('numpy', 'torch', 'click') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    code = ("import sys, runpy; sys.argv = ['ckptfix', '--version']; runpy.run_module('ckptfix', run_name='__main__'); "
            "print(sorted(m for m in ('numpy', 'torch', 'click') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    from ckptfix.cli import VERSION_LINE

    assert out.splitlines() == [VERSION_LINE, "[]"]  # the line click's --version prints, without click


USER_SCRIPT = '''
import ckptfix

{reveals}
ckptfix.repair("ckpt.pth", "tok.model", "out.pth", policy=3)
ckptfix.not_a_public_name
'''


@pytest.mark.slow
def test_mypy_strict_sees_real_types(tmp_path):
    pytest.importorskip("mypy")
    names = [n for n in ckptfix.__all__ if n != "__version__"] + ["integrations"]
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT.format(reveals="\n".join(f"reveal_type(ckptfix.{n})" for n in names)))
    env = {**os.environ, "MYPYPATH": str(ROOT)}  # this checkout, not whatever an editable install points at
    res = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-error-summary",
                          "--cache-dir", str(tmp_path / "cache"), str(script)],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    revealed = re.findall(r'user\.py:(\d+): note: Revealed type is "(.*)"', res.stdout)
    assert len(revealed) == len(names), res.stdout + res.stderr
    for (_line, kind), name in zip(revealed, names):
        assert kind != "Any" and not kind.startswith("Any"), (name, kind)
    errors = re.findall(r"user\.py:\d+: error: (.*)", res.stdout)
    assert errors == [
        'Argument "policy" to "repair" has incompatible type "int"; expected "str | None"  [arg-type]',
        'Module has no attribute "not_a_public_name"  [attr-defined]'], res.stdout
    assert "ckptfix.surgery.RepairResult" in dict(zip(names, (k for _, k in revealed)))["repair"]


def test_python_callers_are_told_the_keyword_argument(tmp_path):
    """An error a Python caller gets names `force=True`; the command line says `--force` for the same error."""
    src = ROOT / "fixtures" / "seed001" / "ckpt.pth"
    tok = ROOT / "fixtures" / "seed001" / "tokenizer.model"
    out = tmp_path / "out.pth"
    out.write_bytes(b"x")
    with pytest.raises(ckptfix.RepairError) as err:
        ckptfix.repair(src, tok, out)
    assert str(err.value) == f"{out}: already exists; pass force=True to replace it"
    res = subprocess.run([sys.executable, "-m", "ckptfix", "repair", str(src), "-t", str(tok), "-o", str(out)],
                         capture_output=True, text=True)
    assert (res.returncode, res.stderr) == (2, f"ckptfix: error: {out}: already exists; pass --force to replace it\n")


def test_inspect_without_a_tokenizer_imports_no_numpy(tmp_path):
    """inspect of metadata (no --tokenizer) never needs numpy: the plan audit's surgery imports come after its
    no-tokenizer return (README's start-up figures count on it). A fresh interpreter, through the API and the CLI."""
    import json
    import struct

    header = json.dumps({"wte.weight": {"dtype": "F32", "shape": [4, 2], "data_offsets": [0, 32]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(32))
    seed = ROOT / "fixtures" / "seed001" / "ckpt.pth"
    for path in (seed, tmp_path / "model.safetensors"):
        code = ("import sys, ckptfix, ckptfix.inspect; r = ckptfix.inspect(sys.argv[1]); assert r.ckpt.model\n"
                "from ckptfix.cli import main\n"
                "try: main(['inspect', sys.argv[1], '-q'])\n"
                "except SystemExit: pass\n"
                "print(sorted(m for m in ('numpy', 'torch') if m in sys.modules))")
        done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert done.returncode == 0, done.stderr[-800:]
        assert done.stdout.strip().splitlines()[-1] == "[]", (path, done.stdout[-300:])
