"""Issue 33, item 9: the fixture scripts a contributor runs do no harm. `make_fixtures.py` never rewrites a
committed checkpoint with CPU float noise (and `--check` writes nothing); `tokenizer_corpus.py --help`
downloads nothing."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _make_fixtures():
    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_float_noise_keeps_the_committed_file(tmp_path, capsys):
    mf = _make_fixtures()
    generated, committed = tmp_path / "gen", tmp_path / "committed"
    for d in (generated, committed):
        (d / "a").mkdir(parents=True)
    w = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    torch.save({"model": {"w": w}, "step": 3}, committed / "a" / "ckpt.pth")
    torch.save({"model": {"w": torch.nextafter(w, w + 1)}, "step": 3}, generated / "a" / "ckpt.pth")  # last bit
    (committed / "a" / "tokenizer.model").write_bytes(b"tok")
    (generated / "a" / "tokenizer.model").write_bytes(b"tok")
    before = (committed / "a" / "ckpt.pth").read_bytes()
    assert mf.update(generated, committed, check=False) == 0
    assert (committed / "a" / "ckpt.pth").read_bytes() == before
    assert capsys.readouterr().out.split() == ["noise", "a/ckpt.pth", "same", "a/tokenizer.model"]

    torch.save({"model": {"w": w + 1e-3}, "step": 3}, generated / "a" / "ckpt.pth")  # a real change
    assert mf.update(generated, committed, check=True) == 1  # --check: reported, not written
    assert (committed / "a" / "ckpt.pth").read_bytes() == before
    assert mf.update(generated, committed, check=False) == 1
    assert (committed / "a" / "ckpt.pth").read_bytes() == (generated / "a" / "ckpt.pth").read_bytes()


def test_tokenizer_corpus_help_downloads_nothing(tmp_path):
    env = {**os.environ, "CKPTFIX_FIXTURE_CACHE": str(tmp_path / "cache")}
    res = subprocess.run([sys.executable, str(FIXTURES / "tokenizer_corpus.py"), "--help"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.startswith("usage: tokenizer_corpus.py")
    assert not (tmp_path / "cache").exists()
