"""A malicious `torch.save` file is inspected without running its payload: exit 2, one line naming the globals.

The payloads are real: objects whose `__reduce__` makes unpickling call os.system / open, saved with
torch.save next to an ordinary state dict. The last test proves they are live by loading one with
torch.load(weights_only=False), which does run it.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


class RunsShell:
    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


class OpensFile:
    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return (open, (str(self.sentinel), "w"))


def malicious_checkpoint(path: Path, payload) -> Path:
    torch.save({"model": {"w": torch.zeros(4, 4)}, "optimizer": {"state": {}, "param_groups": []},
                "epoch": 3, "callback": payload}, path)
    return path


def ckptfix_cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    """The real command line in a fresh interpreter (nothing imported from this test process)."""
    return subprocess.run([sys.executable, "-m", "ckptfix.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.parametrize("payload, global_name", [(RunsShell, "posix.system"), (OpensFile, "io.open")],
                         ids=["os.system", "open"])
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_malicious_pickle_is_refused_without_running(tmp_path, payload, global_name, as_json):
    if os.name != "posix" and global_name == "posix.system":
        pytest.skip("os.system pickles as nt.system on Windows")
    sentinel = tmp_path / "SENTINEL"
    ckpt = malicious_checkpoint(tmp_path / "ckpt.pth", payload(sentinel))
    proc = ckptfix_cli("inspect", ckpt, *(["--json"] if as_json else []), cwd=tmp_path)
    assert proc.returncode == 2
    if as_json:  # issue 18 asks for a JSON error object on stdout under --json; the stderr line stays
        assert json.loads(proc.stdout)["error"] == {"kind": "bad_input", "message": proc.stderr.strip()[16:],
                                                    "exit_code": 2}
    else:
        assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"ckptfix: error: {ckpt}: refusing to unpickle")
    assert f"({global_name})" in lines[0] and "--trust-pickle" in lines[0]
    assert "Traceback" not in proc.stderr
    assert not sentinel.exists()


def test_trust_pickle_reads_the_payload_as_inert_data(tmp_path):
    sentinel = tmp_path / "SENTINEL"
    ckpt = malicious_checkpoint(tmp_path / "ckpt.pth", RunsShell(sentinel))
    proc = ckptfix_cli("inspect", ckpt, "--trust-pickle", "--json", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr  # the call it would make is an error finding, never data
    data = json.loads(proc.stdout)
    assert data["extras"]["callback"] == {"object": "posix.system"}
    assert [f["code"] for f in data["findings"] if f["severity"] == "error"] == ["CKF706"]
    assert data["model"]["tensors"] == 1
    assert not sentinel.exists()


def test_the_payload_is_live_under_torch_load(tmp_path):
    """The control: the same file really does run its payload when unpickled by torch.load(weights_only=False)."""
    sentinel = tmp_path / "SENTINEL"
    ckpt = malicious_checkpoint(tmp_path / "ckpt.pth", RunsShell(sentinel))
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):  # the default refuses it too
        torch.load(ckpt)
    assert not sentinel.exists()
    torch.load(ckpt, weights_only=False)  # harmless here: it touches a file in tmp_path
    assert sentinel.exists()
