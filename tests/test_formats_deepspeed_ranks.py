"""DeepSpeed ZeRO saves of real multi-rank runs (CPU accelerator, gloo), read per parameter.

Two ranks train a tiny LM (embedding, MLP, untied head) under ZeRO-2 (and ZeRO-3 with `-m long`) and
`engine.save_checkpoint`; rank 0 also saves DeepSpeed's own view of every parameter
(`safe_get_full_fp32_param` / `safe_get_full_optimizer_state`). Each parameter's moments (and, at
ZeRO-3, its fp32 weights) are spread over the ranks' flat partitions; ckptfix assembles them, and they
must equal DeepSpeed's view exactly.
"""

from __future__ import annotations

import os
import socket
import sys
import textwrap

import numpy as np
import pytest
import torch
from deepspeed_lm import PRELUDE
from procs import NO_SHM_BUILD, run_ranks

from ckptfix.formats import read_checkpoint
from ckptfix.inspect import inspect

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.deepspeed

VOCAB = 48
_SCRIPT = PRELUDE + NO_SHM_BUILD + textwrap.dedent("""
    import os, sys
    import torch
    import deepspeed
    from torch import nn
    from deepspeed_lm import LM, config, full_view
    out, stage, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(0)
    model = LM(vocab)
    deepspeed.init_distributed(dist_backend="gloo")
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(stage))
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    for _ in range(3):
        ids = torch.randint(0, vocab, (2, 6), generator=g)
        logits = engine(ids[:, :-1])
        engine.backward(nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1)))
        engine.step()
    engine.save_checkpoint(out)
    truth = full_view(engine)
    if int(os.environ["RANK"]) == 0:
        torch.save(truth, out + "_truth.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # everything is written and closed: leave before interpreter teardown, where DeepSpeed's/gloo's threads
    # were seen to abort ("terminate called without an active exception") after a complete save
    os._exit(0)
""")



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_zero(out, stage: int, world: int = 2) -> dict:
    """`world` ranks (one process each, gloo) train and save under ZeRO `stage`; DeepSpeed's own view back."""
    base = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
            "WORLD_SIZE": str(world), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    ranks = run_ranks([sys.executable, "-c", _SCRIPT, str(out), str(stage), str(VOCAB)],
                      [{**base, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(world)], timeout=240)
    if any(rc for rc, _ in ranks):
        pytest.fail("deepspeed run failed:\n" + "\n".join(f"rank {r} ({rc}): {err[-3000:]}" for r, (rc, err)
                                                          in enumerate(ranks) if rc))
    return torch.load(f"{out}_truth.pt")


def check_per_parameter(folder, truth: dict, stage: int) -> None:
    ckpt = read_checkpoint(folder)
    opt = ckpt.optimizer
    assert opt is not None and len(opt.state) == len(truth)
    assert {ps.step for ps in opt.state.values()} == {3.0}
    for name, want in truth.items():
        for key in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(opt.state[name].tensors[key].read(), want[key].numpy())
        np.testing.assert_array_equal(ckpt.model[name].read(), want["fp32"].numpy())
    assert any("world size 2 at save time" in n for n in ckpt.notes)
    data = inspect(folder).to_json()
    assert data["optimizer"]["mapping"] == "fqn"
    assert {v["name"]: v["moments"] for v in data["vocab"]["tensors"]}["embed_tokens.weight"] == {
        "exp_avg": [VOCAB, 8], "exp_avg_sq": [VOCAB, 8]}


def test_zero2_two_ranks_moments_per_parameter(tmp_path):
    truth = run_zero(tmp_path / "z2", 2)
    check_per_parameter(tmp_path / "z2", truth, 2)


@pytest.mark.long
def test_zero3_two_ranks_weights_and_moments_per_parameter(tmp_path):
    truth = run_zero(tmp_path / "z3", 3)
    check_per_parameter(tmp_path / "z3", truth, 3)
