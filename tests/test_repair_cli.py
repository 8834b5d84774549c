"""`ckptfix repair` command-line wiring: exit codes, --json schema, --dry-run text, errors as one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_factory import trained_checkpoint
from test_repair_common import (
    sha256,
    snapshot,
)
from tokenizer_factory import train_bpe_tokenizer_json

from ckptfix.cli import main

REPO = Path(__file__).resolve().parents[1]
OLD, NEW = 100, 120
JSON_KEYS = {"schema", "source", "format", "output", "dry_run", "policy", "init", "target_rows", "tokenizer",
             "from_tokenizer", "changes", "optimizer_state", "scheduler_state", "scaler_reset", "rewarm",
             "findings_before", "notes", "backup", "audit"}
CHANGE_KEYS = {"tensor", "role", "old_shape", "new_shape", "old_rows", "new_rows", "kept", "moved", "new",
               "dropped", "dropped_ids"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    ckpt = trained_checkpoint(d / "ckpt.pth", OLD, steps=5)
    tok = train_bpe_tokenizer_json(d, NEW)  # 120 tokens: the checkpoint has 100 rows
    return ckpt, tok


def run(capsys, *argv) -> tuple[int, str, str]:
    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def test_repair_ok_exit_0_and_text(files, tmp_path, capsys):
    ckpt, tok = files
    digest = sha256(ckpt)
    out = tmp_path / "fixed.pth"
    code, stdout, err = run(capsys, "repair", ckpt, "--tokenizer", tok, "-o", out)
    assert code == 0, err
    assert sha256(ckpt) == digest
    assert f"wrote {out}" in stdout
    assert f"text_embedding.weight  [{OLD}, 16] -> [{NEW}, 16]  kept {OLD}, moved 0, new 20, dropped 0" in stdout
    sd = torch.load(out, weights_only=True)
    assert sd["model"]["text_embedding.weight"].shape == (NEW, 16)
    assert sd["ckptfix"]["source_sha256"] == digest


def test_json_schema(files, tmp_path, capsys):
    ckpt, tok = files
    out = tmp_path / "fixed.pth"
    code, stdout, err = run(capsys, "repair", ckpt, "-t", tok, "-o", out, "--json", "--policy", "fresh",
                            "--init", "zeros", "--pad-to-multiple-of", "64")
    assert code == 0, err
    data = json.loads(stdout)
    assert set(data) == JSON_KEYS
    assert data["schema"] == "ckptfix.repair/1" and data["format"] == "torch" and data["dry_run"] is False
    assert data["output"] == str(out) and data["source"] == str(ckpt)
    assert (data["policy"], data["init"], data["target_rows"]) == ("fresh", "zeros", 128)
    assert (data["optimizer_state"], data["scheduler_state"], data["rewarm"]) == ("dropped", "kept", True)
    assert data["tokenizer"]["size"] == NEW and data["from_tokenizer"] is None and data["backup"] is None
    assert data["changes"] and all(set(c) == CHANGE_KEYS for c in data["changes"])
    assert {c["new_rows"] for c in data["changes"]} == {128}
    assert "CKF101" in data["findings_before"]
    assert torch.load(out, weights_only=True)["model"]["text_head.weight"].shape == (128, 16)


def test_dry_run_prints_the_changes_and_writes_nothing(files, tmp_path, capsys):
    ckpt, tok = files
    before = snapshot(ckpt.parent), snapshot(tmp_path)
    out = tmp_path / "never.pth"
    code, stdout, err = run(capsys, "repair", ckpt, "-t", tok, "-o", out, "--dry-run")
    assert code == 0, err
    assert f"text_embedding.weight  [{OLD}, 16] -> [{NEW}, 16]" in stdout
    assert f"text_head.weight:exp_avg_sq  [{OLD}, 16] -> [{NEW}, 16]" in stdout
    assert "remap" in stdout and f"would write {out}" in stdout
    code, stdout, err = run(capsys, "repair", ckpt, "-t", tok, "--dry-run", "--json")  # no -o needed
    assert code == 0, err
    assert json.loads(stdout)["dry_run"] is True and json.loads(stdout)["output"] is None
    assert (snapshot(ckpt.parent), snapshot(tmp_path)) == before


def test_missing_output_is_exit_2(files, capsys):
    ckpt, tok = files
    code, stdout, err = run(capsys, "repair", ckpt, "-t", tok)
    assert code == 2 and stdout == ""
    assert "ckptfix: error:" in err and "-o" in err and "Traceback" not in err


def test_existing_output_is_exit_2_and_untouched(files, tmp_path, capsys):
    ckpt, tok = files
    out = tmp_path / "exists.pth"
    out.write_bytes(b"keep me")
    code, _, err = run(capsys, "repair", ckpt, "-t", tok, "-o", out)
    assert code == 2 and "already exists" in err and "--force" in err and len(err.strip().splitlines()) == 1
    assert out.read_bytes() == b"keep me"
    code, _, err = run(capsys, "repair", ckpt, "-t", tok, "-o", out, "--force")
    assert code == 0, err
    assert torch.load(out, weights_only=True)["model"]["text_embedding.weight"].shape == (NEW, 16)


def test_in_place_force_keeps_backup(files, tmp_path, capsys):
    ckpt, tok = files
    path = tmp_path / "ckpt.pth"
    path.write_bytes(ckpt.read_bytes())
    original = path.read_bytes()
    code, stdout, err = run(capsys, "repair", path, "-t", tok, "-o", path, "--force")
    assert code == 0, err
    assert f"{path}.bak" in stdout
    assert (tmp_path / "ckpt.pth.bak").read_bytes() == original


@pytest.mark.parametrize("bad", ["missing", "garbage", "folder"])
def test_bad_tokenizer_is_exit_2(files, tmp_path, capsys, bad):
    ckpt, _ = files
    tok = tmp_path / "tok.json"
    if bad == "garbage":
        tok.write_bytes(b"\x00\x01 not a tokenizer")
    elif bad == "folder":
        tok = tmp_path / "empty"
        tok.mkdir()
    out = tmp_path / "out.pth"
    code, stdout, err = run(capsys, "repair", ckpt, "-t", tok, "-o", out)
    assert code == 2, err
    assert err.startswith("ckptfix: error:") and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


def test_bad_checkpoint_and_bad_choice_are_exit_2(files, tmp_path, capsys):
    ckpt, tok = files
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"PK\x03\x04 truncated")
    code, _, err = run(capsys, "repair", junk, "-t", tok, "-o", tmp_path / "o.pth")
    assert code == 2 and err.startswith("ckptfix: error:")
    code, _, err = run(capsys, "repair", ckpt, "-t", tok, "-o", tmp_path / "o.pth", "--policy", "nope")
    assert code == 2 and "nope" in err
    assert not (tmp_path / "o.pth").exists()


def test_real_process_exit_codes(files, tmp_path):
    """The installed entry point path: `python -m ckptfix.cli` returns the codes to the shell."""
    ckpt, tok = files
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    missing = subprocess.run([sys.executable, "-m", "ckptfix.cli", "repair", str(ckpt), "-t", str(tok)],
                             capture_output=True, text=True, cwd=REPO, env=env)
    assert missing.returncode == 2 and "-o" in missing.stderr
    out = tmp_path / "fixed.pth"
    ok = subprocess.run([sys.executable, "-m", "ckptfix.cli", "repair", str(ckpt), "-t", str(tok), "-o", str(out),
                         "--json"], capture_output=True, text=True, cwd=REPO, env=env)
    assert ok.returncode == 0, ok.stderr
    assert set(json.loads(ok.stdout)) == JSON_KEYS and out.exists()
