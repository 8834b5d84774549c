"""Issue 42: a real DCP / torchtitan-style `step-N/` folder missing or tearing a file `dcp.load` reads.

One module-scoped save by `dcp.save` (torchtitan's top-level keys: model, optimizer, lr_scheduler, train_state; two
writer threads, so two data files `__0_0.distcp` and `__0_1.distcp`, as two ranks write one each); each file is then
removed, halved and emptied, `dcp.load` is run on it into a fresh model's state, and ckptfix's one-line refusal must
name the file and say what dcp.load did. Measured (torch 2.13):

    file            removed                                           halved / empty
    .metadata       CheckpointException (AssertionError 'metadata is None; global metadata read failed: ...')
    __0_N.distcp    CheckpointException wrapping FileNotFoundError    CheckpointException wrapping EOFError
                                                                      (names no file)
"""

from __future__ import annotations

import logging
import shutil
import warnings

import pytest
import torch.distributed.checkpoint as dcp
from ckpt_factory import new_run, train
from damage import damage
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from ckptfix.errors import CkptfixError
from ckptfix.inspect import inspect
from ckptfix.latest import latest_checkpoint

FILES = (".metadata", "__0_0.distcp", "__0_1.distcp")


def _state(run, step):
    msd, osd = get_state_dict(run.model, run.optimizer)
    return {"model": msd, "optimizer": osd, "lr_scheduler": run.scheduler.state_dict(), "train_state": {"step": step}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("dcp_resume") / "step-3"
    with warnings.catch_warnings():  # "torch.distributed is disabled ... assuming a single process"
        warnings.simplefilter("ignore")
        dcp.save(_state(train(new_run(vocab=32, tied=True), 3), 3), storage_writer=FileSystemWriter(path, thread_count=2))
    return path


def _resume(path):
    """dcp.load into a fresh run's state: ('ok', None) or the exception it raised (inside CheckpointException)."""
    state = _state(new_run(vocab=32, tied=True, seed=123), 0)
    logging.disable(logging.CRITICAL)  # dcp logs each rank's traceback
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, checkpoint_id=str(path))
    except CheckpointException as exc:
        inner = next(iter(exc.failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner  # torch keeps (exception, traceback)
        return type(exc).__name__, inner
    finally:
        logging.disable(logging.NOTSET)
    return "ok", state["train_state"]["step"]


def test_healthy_folder_reads_and_loads(saved, tmp_path):
    d = tmp_path / "step-3"
    shutil.copytree(saved, d)
    assert sorted(p.name for p in d.iterdir()) == sorted(FILES)
    assert inspect(str(d)).exit_code == 0
    assert _resume(d) == ("ok", 3)


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("how", ["removed", "half", "zero"])
def test_damaged_file_is_refused_naming_it_and_what_dcp_load_does(saved, tmp_path, name, how):
    d = tmp_path / "step-3"
    shutil.copytree(saved, d)
    damage(d / name, how)
    outcome, inner = _resume(d)
    assert outcome == "CheckpointException"
    with pytest.raises(CkptfixError) as refused:
        inspect(str(d))
    text = str(refused.value)
    assert "\n" not in text and name in text and "dcp.load raises CheckpointException" in text
    if name == ".metadata":
        assert isinstance(inner, AssertionError) and "metadata is None" in str(inner) and "metadata is None" in text
    else:
        assert type(inner).__name__ in text  # FileNotFoundError / EOFError
        assert isinstance(inner, FileNotFoundError if how == "removed" else EOFError)
        assert (name in str(inner)) == (how == "removed")  # an EOFError names no file: ckptfix does
    reasons = latest_checkpoint(tmp_path).checked[0].reasons
    assert len(reasons) == 1 and name in reasons[0] or (name == ".metadata" and how != "removed")


@pytest.mark.long  # a two-rank run
@pytest.mark.slow
def test_two_ranks_torchtitan_layout_missing_rank_file(tmp_path):
    """torchtitan's layout written by two FSDP2 ranks on gloo, rank 1's data file gone: refused naming __1_0.distcp
    (what dcp.load does without a data file is measured above)."""
    from fsdp_factory import save_run

    folder = tmp_path / "step-3"
    save_run(folder, world=2, layout="titan")
    assert {"__0_0.distcp", "__1_0.distcp"} <= {p.name for p in folder.iterdir()}
    assert inspect(str(folder)).exit_code == 0
    (folder / "__1_0.distcp").unlink()
    with pytest.raises(CkptfixError, match=r"__1_0\.distcp is missing .*dcp\.load raises CheckpointException"):
        inspect(str(folder))
    assert latest_checkpoint(tmp_path).path is None
