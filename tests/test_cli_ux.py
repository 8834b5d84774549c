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
from ckpt_factory import new_run, save_checkpoint, train
from tokenizer_factory import train_sentencepiece

import ckptfix
from ckptfix.cli import main
from ckptfix.errors import RepairError

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


def test_json_error_object_under_json(capsys, monkeypatch, tmp_path):
    """Issue 18: under --json an exit 2 or 3 also prints a JSON error object on stdout; the one stderr line
    stays, and without --json stdout stays empty."""
    missing = str(tmp_path / "nope.pth")
    code, out, err = run_cli(["inspect", missing], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    code, out, err = run_cli(["inspect", missing, "--json"], capsys)
    assert code == 2 and err.count("\n") == 1 and json.loads(out) == {
        "schema": "ckptfix.error/1", "error": {"kind": "bad_input", "message": err.strip()[len("ckptfix: error: "):],
                                               "exit_code": 2}}
    code, out, _ = run_cli(["repair", missing, "--json"], capsys)  # no --tokenizer: a usage error
    assert code == 2 and json.loads(out)["error"]["kind"] == "usage"
    code, out, _ = run_cli(["inspect", "--", "--json"], capsys)  # a file named --json is not the option
    assert code == 2 and out == ""

    def bug(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(sys.modules["ckptfix.inspect"], "inspect", bug)
    monkeypatch.delenv("CKPTFIX_DEBUG", raising=False)
    code, out, err = run_cli(["inspect", missing, "--json"], capsys)
    assert code == 3 and "internal error" in err and json.loads(out)["error"] == {
        "kind": "internal", "message": "ZeroDivisionError: a bug", "exit_code": 3}


def test_safetensors_input_named_pth_writes_a_torch_state_dict(tmp_path, capsys):
    """Issue 18: `-o x.pth` from a .safetensors input writes what torch.save(state_dict) writes (it wrote
    safetensors bytes under a .pth name before); unchanged tensors and kept rows are bit-identical."""
    from safetensors.torch import save_file

    run = train(new_run(64), 3)
    state = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    save_file(state, tmp_path / "model.safetensors")
    tok = train_sentencepiece(tmp_path, 80, name="sp")
    for name in ("model.pth", "model.bin"):
        code, out, err = run_cli(["repair", str(tmp_path / "model.safetensors"), "-t", str(tok), "-o",
                                  str(tmp_path / name)], capsys)
        assert code == 0, err
        loaded = torch.load(tmp_path / name, weights_only=True)
        assert list(loaded) == sorted(state)  # safetensors keeps names sorted
        for key, value in state.items():
            if value.shape[0] == 64 and key in ("text_embedding.weight", "text_head.weight", "text_head.bias"):
                assert loaded[key].shape[0] == 80 and torch.equal(loaded[key][:64], value), key
            else:
                assert torch.equal(loaded[key], value), key
        assert json.loads((tmp_path / f"{name}.ckptfix.json").read_text())["schema"].startswith("ckptfix.repair")
    grown = new_run(80).model
    grown.load_state_dict(torch.load(tmp_path / "model.pth", weights_only=True))  # strict: every key, every shape
    assert ckptfix.inspect(tmp_path / "model.pth", tok).exit_code == 0
    with pytest.raises(RepairError, match=r"\.pth, \.pt or \.bin"):
        ckptfix.repair(tmp_path / "model.safetensors", tok, tmp_path / "model.ckpt", dry_run=True)
    assert not (tmp_path / "model.ckpt").exists()


def test_bare_state_dict_named_safetensors_writes_safetensors(tmp_path, capsys):
    """A bare `model.state_dict()` repaired to a .safetensors name is written as safetensors (tied names each
    with the same values, views materialised); a checkpoint with more than weights is refused, saying why."""
    from safetensors.torch import load_file

    run = train(new_run(64, tied=True), 3)
    state = dict(run.model.state_dict())
    assert state["text_head.weight"].data_ptr() == state["text_embedding.weight"].data_ptr()
    torch.save({**state, "view.t": state["blocks.0.1.weight"].t()}, tmp_path / "sd.pth")
    tok = train_sentencepiece(tmp_path, 80, name="sp")
    code, _, err = run_cli(["repair", str(tmp_path / "sd.pth"), "-t", str(tok), "-o", str(tmp_path / "sd.safetensors")],
                           capsys)
    assert code == 0, err
    loaded = load_file(tmp_path / "sd.safetensors")
    assert torch.equal(loaded.pop("view.t"), state["blocks.0.1.weight"].t())
    assert torch.equal(loaded["text_head.weight"], loaded["text_embedding.weight"])  # tied: the same new rows
    for key, value in state.items():
        got = loaded[key]
        assert torch.equal(got[:64], value) if key.startswith("text_") else torch.equal(got, value), key
    grown = new_run(80, tied=True).model
    grown.load_state_dict(loaded)  # strict
    assert (tmp_path / "sd.safetensors.ckptfix.json").exists()
    torch.save({**state, "step": 3}, tmp_path / "mixed.pth")
    with pytest.raises(RepairError, match="entry 'step' is not a tensor"):
        ckptfix.repair(tmp_path / "mixed.pth", tok, tmp_path / "mixed.safetensors")
