"""The progress bar: bytes done / total and an ETA on a terminal, only for work over a second, never when
piped or with --quiet. (The real-terminal check on a multi-GB bench checkpoint is manual: see the issue.)"""

from __future__ import annotations

import io
import subprocess
import sys

from ckpt_factory import trained_checkpoint

import ckptfix.progress as progress_mod
from ckptfix.progress import terminal_progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Sized:
    def __init__(self, nbytes: int):
        self.nbytes = nbytes


def test_bar_shows_bytes_and_eta_only_on_a_terminal(monkeypatch):
    monkeypatch.setattr(progress_mod, "DELAY", 0.0)
    tty = _Tty()
    items = [_Sized(600_000_000), _Sized(600_000_000)]
    assert list(terminal_progress(stream=tty)(items, 1_200_000_000, "repair")) == items
    out = tty.getvalue()
    assert "repair" in out and "1.20 GB / 1.20 GB" in out and "100%" in out and "ETA" in out
    assert out.endswith("\n")
    assert terminal_progress(stream=io.StringIO()) is None  # not a terminal: no bar
    assert terminal_progress(quiet=True, stream=_Tty()) is None  # --quiet


def test_short_work_draws_nothing():
    tty = _Tty()
    list(terminal_progress(stream=tty)([_Sized(10)], 10, "diff"))  # well under a second
    assert tty.getvalue() == ""


def test_piped_repair_prints_no_bar(tmp_path):
    ckpt = trained_checkpoint(tmp_path / "c.pth", 40, steps=2)
    from tokenizer_factory import train_bpe_tokenizer_json

    tok = train_bpe_tokenizer_json(tmp_path, 60)
    res = subprocess.run([sys.executable, "-m", "ckptfix.cli", "repair", str(ckpt), "-t", str(tok), "-o",
                          str(tmp_path / "out.pth")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "ETA" not in res.stderr and "\r" not in res.stderr
