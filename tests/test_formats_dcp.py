"""torch.distributed.checkpoint folders written by real `dcp.save` in one process (no process group).

What torch 2.13 writes (and this test pins): `.metadata` (a pickled Metadata) and `__0_0.distcp`,
in which every item is its own complete `torch.save` zip at `(offset, length)`; a tensor's raw bytes
are that zip's `data/0` record. `TensorInfo.read()` must equal what `dcp.load` restores.
"""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt_factory import new_run, train
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from ckptfix.errors import UnsafePickle
from ckptfix.formats import dcp_folder, read_checkpoint
from ckptfix.inspect import inspect

STEPS = 4


def _save(state: dict, path) -> None:
    with warnings.catch_warnings():  # "torch.distributed is disabled ... assuming a single process"
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path))


def _load(state: dict, path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(path))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("dcp") / "ckpt"
    run = train(new_run(vocab=32, tied=True), STEPS)
    msd, osd = get_state_dict(run.model, run.optimizer)
    _save({"model": msd, "optim": osd, "sched": run.scheduler.state_dict(), "step": run.step}, path)
    assert not torch.distributed.is_initialized()
    return path, run


def _fresh(run):
    """A same-shaped model/optimizer whose state dcp.load overwrites in place."""
    fresh = new_run(vocab=32, tied=True, seed=123)
    msd, osd = get_state_dict(fresh.model, fresh.optimizer)
    return {"model": msd, "optim": osd}


def test_layout_items_are_torch_save_zips(saved):
    path, _ = saved
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp"]
    items, version = dcp_folder.read_metadata(str(path))
    item = items["model.text_embedding.weight"]
    file, offset, length, _ = item.blobs[0]
    head = (path / "__0_0.distcp").read_bytes()[offset:offset + 4]
    assert head == b"PK\x03\x04" and length > item.shape[0] * item.shape[1] * 4  # a zip, not raw bytes
    assert item.path == ("model", "text_embedding.weight") and version


def test_model_optimizer_scheduler(saved):
    path, run = saved
    ckpt = read_checkpoint(path)
    assert ckpt.format == "dcp"
    want = run.model.state_dict()
    assert {n: t.shape for n, t in ckpt.model.items()} == {n: tuple(t.shape) for n, t in want.items()}
    opt = ckpt.optimizer
    assert opt.kind == "AdamW" and len(opt.state) == len(list(run.model.parameters()))
    assert all(isinstance(p, str) for p in opt.indices())  # FQN-keyed, as get_state_dict saves it
    assert {ps.step for ps in opt.state.values()} == {float(STEPS)}
    assert opt.groups[0].lr == pytest.approx(run.optimizer.param_groups[0]["lr"])
    assert ckpt.scheduler["last_epoch"] == STEPS and ckpt.scheduler["base_lrs"] == [3e-3]
    assert ckpt.extras["step"] == STEPS


def test_values_equal_dcp_load(saved):
    path, run = saved
    ckpt = read_checkpoint(path)
    loaded = _fresh(run)
    _load(loaded, path)
    for name, tensor in loaded["model"].items():
        np.testing.assert_array_equal(ckpt.model[name].read(), tensor.numpy())
    for fqn, entries in loaded["optim"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(ckpt.optimizer.state[fqn].tensors[key].read(), entries[key].numpy())


def test_inspect_maps_by_fqn_without_findings(saved):
    report = inspect(saved[0])
    data = report.to_json()
    assert data["optimizer"]["mapping"] == "fqn" and data["optimizer"]["step"] == float(STEPS)
    assert report.exit_code == 0


def test_metadata_reader_needs_no_torch(saved):
    """The `.metadata` pickle is interpreted from opaque records: nothing from torch is imported."""
    items, _ = dcp_folder.read_metadata(str(saved[0]))
    assert items["optim.state.blocks.0.1.weight.exp_avg"].path == ("optim", "state", "blocks.0.1.weight", "exp_avg")
    assert not items["optim.param_groups.0.lr"].is_tensor


def test_metadata_naming_another_class_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps({"x": Evil()}))
    with pytest.raises(UnsafePickle, match="builtins.print"):
        read_checkpoint(tmp_path)


def test_bare_model_state_dict(tmp_path):
    model = nn.Linear(3, 2)
    _save(model.state_dict(), tmp_path / "bare")
    ckpt = read_checkpoint(tmp_path / "bare")
    assert set(ckpt.model) == {"weight", "bias"} and ckpt.optimizer is None
    np.testing.assert_array_equal(ckpt.model["weight"].read(), model.weight.detach().numpy())


def test_missing_data_file_is_named(saved, tmp_path):
    from ckptfix.errors import UnreadableCheckpoint

    (tmp_path / ".metadata").write_bytes((saved[0] / ".metadata").read_bytes())
    with pytest.raises(UnreadableCheckpoint, match="__0_0.distcp"):
        read_checkpoint(tmp_path)
