"""DeepSpeed checkpoint folders written by the real `deepspeed` engine (CPU, one process).

A subprocess trains a tiny model for 3 steps under ZeRO stages 0, 2, 3 and bf16 + stage 1, calls
`engine.save_checkpoint`, and saves DeepSpeed's own view of the result for comparison: the full fp32
parameters and Adam moments of every parameter (`deepspeed.utils.safe_get_full_fp32_param` /
`safe_get_full_optimizer_state`, or the torch optimizer's state at stage 0). It runs in a subprocess
because DeepSpeed initialises a process group; its shared-memory comm op is stubbed out there so the
test never waits for a C++ JIT build (that op only speeds up multi-rank all-reduce).
"""

from __future__ import annotations

import os
import socket
import sys
import textwrap

import numpy as np
import pytest
import torch
from procs import NO_SHM_BUILD, run

from ckptfix.formats import deepspeed_folder, read_checkpoint
from ckptfix.inspect import inspect

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.deepspeed

CONFIGS = {"s0": (0, False), "s2": (2, False), "s3": (3, False), "bf16": (1, True)}

_SCRIPT = NO_SHM_BUILD + textwrap.dedent("""
    import os, sys
    import torch
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from torch import nn
    out = sys.argv[1]
    for name, (stage, bf16) in {configs!r}.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        cfg = {{"train_micro_batch_size_per_gpu": 2,
               "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}}}},
               "scheduler": {{"type": "WarmupLR", "params": {{"warmup_num_steps": 10}}}},
               "zero_optimization": {{"stage": stage}}, "bf16": {{"enabled": bf16}}}}
        engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        for _ in range(3):
            x = torch.randn(2, 4, dtype=torch.bfloat16 if bf16 else torch.float32)
            engine.backward(engine(x).float().pow(2).mean())
            engine.step()
        engine.save_checkpoint(os.path.join(out, name))
        truth = {{}}
        for pname, p in engine.module.named_parameters():
            if stage == 0:
                st = opt.state[p]
                truth[pname] = {{"fp32": p.detach().float().clone(), "exp_avg": st["exp_avg"].clone(),
                                "exp_avg_sq": st["exp_avg_sq"].clone()}}
            else:
                truth[pname] = {{"fp32": safe_get_full_fp32_param(p).clone(),
                                "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
                                "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone()}}
        torch.save(truth, os.path.join(out, name + "_truth.pt"))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepspeed")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = run([sys.executable, "-c", _SCRIPT.format(configs=CONFIGS), str(out)], env=env, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"deepspeed run failed:\n{proc.stderr[-3000:]}")
    return out


NAMES = {"0.weight": (8, 4), "0.bias": (8,), "2.weight": (2, 8), "2.bias": (2,)}


def test_layout_is_what_the_reader_expects(ds_dir):
    assert (ds_dir / "s2" / "latest").read_text().strip() == "global_step3"
    assert (ds_dir / "s2" / "global_step3" / "mp_rank_00_model_states.pt").exists()
    assert (ds_dir / "s2" / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").exists()
    assert (ds_dir / "s3" / "global_step3" / "zero_pp_rank_0_mp_rank_00_model_states.pt").exists()
    assert (ds_dir / "bf16" / "global_step3" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").exists()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_model_optimizer_step_and_values(ds_dir, name):
    stage, bf16 = CONFIGS[name]
    ckpt = read_checkpoint(ds_dir / name)
    truth = torch.load(ds_dir / f"{name}_truth.pt")
    assert ckpt.format == "deepspeed"
    assert {n: t.shape for n, t in ckpt.model.items()} == NAMES
    assert ckpt.extras["global_steps"] == 3
    assert ckpt.scheduler == {"last_batch_iteration": 2}
    opt = ckpt.optimizer
    assert opt.kind == "AdamW" and len(opt.state) == 4
    assert {ps.step for ps in opt.state.values()} == {3.0}
    for pname, want in truth.items():
        index = pname if stage else list(NAMES).index(pname)  # ZeRO state is FQN-keyed; stage 0 by position
        for key in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(opt.state[index].tensors[key].read(), want[key].numpy())
        weights = ckpt.model[pname].read()
        if bf16:  # module holds the bf16 model; the fp32 master copy rounds to it
            np.testing.assert_array_equal(weights, want["fp32"].to(torch.bfloat16).float().numpy())
        else:
            np.testing.assert_array_equal(weights, want["fp32"].numpy())
    if stage:
        info = ckpt.extras["deepspeed"]
        assert info["zero_stage"] == stage and info["partitions"][0]["flat_numel"] == [58]
        assert any("partition" in n for n in ckpt.notes)


def test_inspect_is_clean_and_maps_by_fqn(ds_dir):
    report = inspect(ds_dir / "s3")
    data = report.to_json()
    assert data["optimizer"]["mapping"] == "fqn" and data["optimizer"]["step"] == 3.0
    assert data["model"]["tensors"] == 4 and report.exit_code == 0


def test_tag_folder_is_readable_directly(ds_dir):
    ckpt = read_checkpoint(ds_dir / "s3" / "global_step3")
    assert set(ckpt.model) == set(NAMES)


def test_strict_reader_still_refuses_unknown_classes(ds_dir, tmp_path):
    """Only DeepSpeed's own records are read opaquely; any other class stays refused."""
    from ckptfix.errors import UnsafePickle

    src = ds_dir / "s2" / "global_step3"
    dst = tmp_path / "global_step3"
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    states = torch.load(dst / "mp_rank_00_model_states.pt", weights_only=False)
    states["client"] = socket.AF_INET  # an enum from an unrelated module
    torch.save(states, dst / "mp_rank_00_model_states.pt")
    with pytest.raises(UnsafePickle, match="socket"):
        read_checkpoint(dst)
    assert set(read_checkpoint(dst, trust_pickle=True).model) == set(NAMES)


def test_repair_unsupported_points_at_ds_to_universal(ds_dir):
    message = deepspeed_folder.repair_unsupported(str(ds_dir / "s2"))
    assert "ds_to_universal" in message and "global_step3" in message


@pytest.mark.parametrize("field, value, message", [
    ("partition_count", float("inf"), "partition_count: expected an integer in [1, 1048576], got inf"),
    ("base_optimizer_state", {"state": [1, 2], "param_groups": []}, "base_optimizer_state.state: expected a dict, got a list"),
    ("base_optimizer_state", {"state": {0: 5}, "param_groups": []}, "base optimizer state[0]: expected a dict, got 5"),
    ("param_slice_mappings", 7, "param_slice_mappings: expected a list of at most 16,777,216 items, got 7"),
])
def test_wrong_typed_partition_fields_are_one_line_exit_2(ds_dir, tmp_path, field, value, message):
    """Issue 19: a real ZeRO-2 save with one optim-states field of the wrong type: exit 2 naming it."""
    import shutil

    import malicious_corpus as mc

    src = tmp_path / "s2"
    shutil.copytree(ds_dir / "s2", src)
    optim = next((src / "global_step3").glob("*optim_states.pt"))
    tree = torch.load(optim, weights_only=False)  # our own DeepSpeed run's file
    tree["optimizer_state_dict"][field] = value
    torch.save(tree, optim)
    r = mc.run_batch([{"id": 0, "argv": ["inspect", str(src)]}], cwd=tmp_path)[0]
    assert (r["code"], r["stderr"].strip()) == (2, f"ckptfix: error: {optim}: {message}")


def test_the_hinted_conversion_runs_and_its_output_repairs(ds_dir, tmp_path):
    """The command repair_unsupported prints, run as printed (DeepSpeed's ds_to_universal on the bf16 ZeRO-1
    save), gives a folder `ckptfix repair` rewrites: the rows of `0.weight`/`0.bias` (8 -> 9, as a vocab
    would) in the fp32 and moment files, and in the bf16 `module` as the new fp32 values cast to bf16;
    `param_shapes` keeps torch.Size values. (Resuming it with DeepSpeed: test_repair_deepspeed_universal.)"""
    import re
    import shlex
    import shutil

    from tokenizers import Tokenizer, models

    from ckptfix.cli import main

    src = tmp_path / "bf16"
    shutil.copytree(ds_dir / "bf16", src)
    message = deepspeed_folder.repair_unsupported(str(src))
    command = shlex.split(re.search(r"python -m (deepspeed\S+ .*?--inject_missing_state)", message).group(1))
    run([sys.executable, "-m", *command], check=True, timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    universal = src / "global_step3_universal"
    assert f"ckptfix repair {universal}" in message
    tok = tmp_path / "tok.json"
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(9)}, unk_token="t0")).save(str(tok))
    # `2.weight` [2, 8] reads the 8 outputs of `0`: the audit names it (8 is the "vocab" here); kept on purpose
    main(["repair", str(universal), "-t", str(tok), "-o", str(tmp_path / "fixed"), "--keep", "2.weight"])
    truth = torch.load(ds_dir / "bf16_truth.pt")
    fixed = read_checkpoint(tmp_path / "fixed")
    assert fixed.format == "deepspeed-universal"
    for name in ("0.weight", "0.bias"):
        assert fixed.model[name].shape[0] == 9
        np.testing.assert_array_equal(fixed.model[name].read()[:8], truth[name]["fp32"].numpy())
        for key in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(fixed.optimizer.state[name].tensors[key].read()[:8], truth[name][key].numpy())
        assert fixed.optimizer.state[name].step == 3.0
    states = torch.load(tmp_path / "fixed" / "mp_rank_00_model_states.pt", weights_only=False)
    for name in ("0.weight", "0.bias"):
        fp32 = torch.from_numpy(fixed.model[name].read().copy())
        assert states["module"][name].dtype == torch.bfloat16 and states["module"][name].shape[0] == 9
        assert torch.equal(states["module"][name], fp32.to(torch.bfloat16))
    shapes = states["param_shapes"][0]
    assert type(shapes["0.weight"]) is torch.Size and shapes["0.weight"] == (9, 4) and shapes["2.weight"] == (2, 8)
