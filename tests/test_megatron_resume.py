"""Megatron-Core's own `dist_checkpointing.load` resumes the repaired torch_dist folders (`-m long`).

Runs fixtures/megatron.py's `resume` with the megatron venv's python (megatron-core 0.16.1 beside torch 2.13.0+cpu,
see fixtures/megatron.py): ranks on gloo build a GPTModel for the new tokenizer (300 tokens, rows padded to
128 x TP), load the repaired folder with Megatron's loader and the model's own sharded state dict, load the
optimizer and scheduler, and train one step. The loaded vocab tensors and Adam moments (gathered over the TP
ranks) must be what repair wrote, bit for bit. Skipped where the venv is missing:

    python -m venv --system-site-packages /work/venvs/megatron
    /work/venvs/megatron/bin/pip install --no-deps megatron-core==0.16.1
    PYTHONPATH=$PWD python -m pytest -m long tests/test_megatron_resume.py   (CKPTFIX_MEGATRON_PYTHON: another venv)
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_formats_megatron import ADAM_TP2, EMBED, FULLY_TP1, HEAD, OLD_TOKENS, ROWS, run, toks  # noqa: F401

from ckptfix.formats import read_checkpoint

pytestmark = pytest.mark.long
SCRIPT = Path(__file__).resolve().parent.parent / "fixtures" / "megatron.py"
PYTHON = os.environ.get("CKPTFIX_MEGATRON_PYTHON", "/work/venvs/megatron/bin/python")


def _megatron_available() -> bool:
    if not os.path.exists(PYTHON):
        return False
    probe = subprocess.run([PYTHON, "-c", "import megatron.core"], capture_output=True, cwd="/")
    return probe.returncode == 0


needs_megatron = pytest.mark.skipif(not _megatron_available(), reason=f"no megatron-core venv at {PYTHON}")


def resume(folder: Path, tp: int, dp: int, opt: str, dump: Path) -> dict:
    out = subprocess.run([PYTHON, str(SCRIPT), "resume", str(folder), "--vocab", "300", "--tp", str(tp), "--dp",
                          str(dp), "--opt", opt, "--hidden", "8", "--dump", str(dump)],
                         capture_output=True, text=True, timeout=900, cwd=str(SCRIPT.parent.parent),
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _saved(ckpt, key: str) -> np.ndarray:
    """A checkpoint key's array as ckptfix reads it (model tensor or optimizer.state.<key>.<fqn>)."""
    if key.startswith("optimizer.state."):
        moment, _, name = key[len("optimizer.state."):].partition(".")
        if moment == "param":
            from ckptfix.formats.dcp_folder import tensor_info

            return tensor_info(ckpt.raw.iteration_dir, ckpt.raw.items[key], []).read_stored()
        return ckpt.optimizer.state[name].tensors[moment].read_stored()
    return ckpt.model[key].read_stored()


@needs_megatron
@pytest.mark.parametrize("source, pad_to, tp, opt", [
    (ADAM_TP2, None, 2, "adam"),  # the same TP: 300 tokens -> 512 rows (128 x 2)
    (ADAM_TP2, 128, 1, "adam"),  # another TP: repaired for TP 1's 384 rows
    (FULLY_TP1, 256, 2, "dist-fully_reshardable"),  # distributed optimizer, TP 1 -> TP 2 (512 rows)
], ids=["adam-tp2-tp2", "adam-tp2-tp1", "fully-tp1-tp2"])
def test_megatron_resumes_the_repaired_folder(source, pad_to, tp, opt, toks, tmp_path):  # noqa: F811
    out = tmp_path / "fixed"
    args = ["repair", source, "-t", toks[1], "-o", out] + (["--pad-to", str(pad_to)] if pad_to else [])
    result = run(*args)
    assert result.exit_code == 0, result.output
    rows = 128 * tp * -(-300 // (128 * tp))
    got = resume(out, tp, 2, opt, tmp_path / "loaded.npz")
    assert got["finite"] and got["rows"] == rows and got["padded_vocab_size"] == rows and got["iteration"] == 2
    assert got["scheduler_steps"] == 3  # the schedule continued from its 2 saved steps
    loaded, repaired, original = np.load(tmp_path / "loaded.npz"), read_checkpoint(out), read_checkpoint(source)
    assert {EMBED, HEAD} <= set(loaded.files)
    if opt == "adam" or any(k.startswith("optimizer.state.") for k in loaded.files):
        assert {f"optimizer.state.exp_avg_sq.{EMBED}", f"optimizer.state.exp_avg.{HEAD}"} <= set(loaded.files)
    for key in loaded.files:
        np.testing.assert_array_equal(loaded[key], _saved(repaired, key), err_msg=key)
        np.testing.assert_array_equal(loaded[key][:OLD_TOKENS], _saved(original, key)[:OLD_TOKENS], err_msg=key)
        assert loaded[key].shape[0] == rows


@needs_megatron
def test_megatron_zero_fills_an_unrepaired_checkpoint(tmp_path):
    """CKF161's claim, measured: Megatron loads the 256-row checkpoint into a model built for 300 tokens (512
    rows) without an error; rows 256..511 of the weights and exp_avg_sq are zeros under the inherited step."""
    got = resume(ADAM_TP2, 2, 2, "adam", tmp_path / "loaded.npz")
    assert got["finite"] and got["rows"] == 512 and got["padded_vocab_size"] == ROWS
    loaded, original = np.load(tmp_path / "loaded.npz"), read_checkpoint(ADAM_TP2)
    for key in (EMBED, f"optimizer.state.exp_avg_sq.{EMBED}"):
        assert loaded[key].shape[0] == 512 and not loaded[key][ROWS:].any()
        np.testing.assert_array_equal(loaded[key][:ROWS], _saved(original, key))
