"""Command-line details a new user meets first (issue 18): `python -m ckptfix`, `explain`, a lone optimizer
state dict, `diff` of a checkpoint with itself, shell-quoted fix
hints, output names that promise another format, py.typed, and the README's callback spelling."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptfix
from ckpt_factory import new_run, save_checkpoint, train
from ckptfix.cli import main
from ckptfix.errors import RepairError
from tokenizer_factory import train_sentencepiece

ROOT = Path(__file__).resolve().parent.parent


def run_cli(args, capsys):
    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ux dir")  # a space in the path: fix hints must quote it
    path = save_checkpoint(train(new_run(64), 3), d / "my ckpt.pth")
    return path


def test_python_dash_m_ckptfix():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "ckptfix", "explain", "CKF101"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("CKF101 (error)")


def test_explain(capsys):
    code, out, _ = run_cli(["explain", "ckf120"], capsys)
    assert code == 0 and out.startswith("CKF120 (error): tokens changed id")
    code, out, _ = run_cli(["explain", "CKF822"], capsys)  # guard codes too
    assert code == 0 and "optimizer state" in out
    code, _, err = run_cli(["explain", "CKF999"], capsys)
    assert code == 2 and "unknown code" in err


def test_lone_optimizer_state_dict(capsys, tmp_path):
    run = train(new_run(64), 3)
    torch.save(run.optimizer.state_dict(), tmp_path / "optimizer.pt")
    report = ckptfix.inspect(tmp_path / "optimizer.pt")
    assert report.ckpt.optimizer is not None and len(report.ckpt.optimizer.state) == len(list(run.model.parameters()))
    assert report.exit_code == 0 and any("lone optimizer" in n for n in report.to_json()["notes"])


def test_diff_with_itself_is_the_same_step(ckpt, capsys):
    report = ckptfix.diff(ckpt, ckpt)
    assert report.same_step and report.exit_code == 0 and report.verdict.startswith("same step")
    code, out, _ = run_cli(["diff", str(ckpt), str(ckpt)], capsys)
    assert code == 0 and "same step" in out


def test_fix_hints_are_shell_quoted(ckpt, tmp_path):
    tok = train_sentencepiece(tmp_path, 80, name="sp")
    report = ckptfix.inspect(ckpt, tok)
    fix = next(f.fix for f in report.findings if f.code == "CKF101")
    words = shlex.split(fix)
    assert words[:3] == ["ckptfix", "repair", str(ckpt)] and words[words.index("-o") + 1].endswith("my ckpt.fixed.pth")


def test_output_name_that_promises_another_format_is_refused(ckpt, tmp_path):
    tok = train_sentencepiece(tmp_path, 80, name="sp")
    with pytest.raises(RepairError, match=r"\.safetensors name"):
        ckptfix.repair(ckpt, tok, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_py_typed_and_the_readme_callback_spelling():
    assert (ROOT / "ckptfix" / "py.typed").exists()
    pytest.importorskip("transformers")
    code = "import ckptfix; print(type(ckptfix.integrations.transformers.ResumeGuardCallback()).__name__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.strip() == "ResumeGuardCallback", done.stderr[-500:]


def test_select_and_ignore_like_ruff(ckpt, tmp_path, capsys):
    tok = train_sentencepiece(tmp_path, 80, name="sp")
    code, out, _ = run_cli(["inspect", str(ckpt), "-t", str(tok), "--json"], capsys)
    assert code == 1 and "CKF101" in {f["code"] for f in json.loads(out)["findings"]}
    code, out, _ = run_cli(["inspect", str(ckpt), "-t", str(tok), "--json", "--ignore", "CKF101"], capsys)
    assert "CKF101" not in {f["code"] for f in json.loads(out)["findings"]}
    code, out, _ = run_cli(["inspect", str(ckpt), "-t", str(tok), "--json", "--select", "CKF3"], capsys)
    assert all(f["code"].startswith("CKF3") for f in json.loads(out)["findings"])
