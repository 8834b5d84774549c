"""Real FSDP2 runs on CPU ranks (gloo), saved and resumed with `torch.distributed.checkpoint`.

`save_run` spawns `world` processes, shards a TinyLM with `fully_shard` (each block, then the root),
trains it with AdamW + LambdaLR for real steps and saves with `dcp.save` in one of the layouts real
frameworks write:

- "nested":  `{"model": msd, "optim": osd, "sched": ..., "step": n}` from `get_state_dict`;
- "titan":   torchtitan's CheckpointManager layout: the model's FQNs at the top level, `optimizer` the
             flattened optimizer state dict (`flatten_optimizer_state_dict=True`: `state.<fqn>.exp_avg`,
             `param_groups.<fqn>.lr`), `lr_scheduler`, `dataloader` and `train_state` (whose step is an
             int32 tensor and whose loss history is a BytesIO, as torchtitan's TrainState saves them);
- "lightning": Lightning's ModelParallelStrategy with `save_distributed_checkpoint=True`: `state_dict`
             and `optimizer_0` through DCP, the rest (`lr_schedulers`, `global_step`) `torch.save`d by
             rank 0 into `meta.pt` beside it.

Rank 0 also `torch.save`s the full (gathered) model and optimizer state as a reference, so tests compare
against what training really held. `resume_run` loads a folder the DCP way on `world` ranks for a model
built at another vocab, checks nothing, and returns the gathered state after loading plus one real step.
"""

from __future__ import annotations

import io
import math
import os
import socket
import time
import warnings
from pathlib import Path

import torch
import torch._dynamo
import torch.distributed as dist
import torch.distributed.checkpoint
import torch.distributed.fsdp
import torch.multiprocessing as mp
from ckpt_factory import TinyLM, lm_loss, make_batches, warmup_lambda
from procs import kill_processes

LR, WARMUP = 3e-3, 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, world: int, *args, timeout: float = 300) -> None:
    port = _free_port()
    # fork: the children start with torch already imported (spawn re-imports it: seconds per rank)
    context = mp.start_processes(_entry, args=(world, port, fn, args), nprocs=world, join=False, start_method="fork")
    deadline = time.monotonic() + timeout
    try:  # join raises at a rank's failure (killing its peers); past the deadline, the finally kills every rank
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} FSDP ranks still running after {timeout} s")
    finally:
        kill_processes(context.processes)


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def _build(vocab: int, tied: bool, seed: int = 0):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = TinyLM(vocab, dim=16, layers=2, tied=tied)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_lambda(WARMUP))
    return model, optimizer, scheduler


def _step(model, optimizer, scheduler, ids) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = lm_loss(model, ids)
    loss.backward()
    optimizer.step()
    scheduler.step()
    return float(loss)


def _batches(vocab: int, steps: int, rank: int, world: int, seed: int = 1):
    # every rank its own slice of one global batch stream: data parallel, as FSDP trains
    return make_batches(vocab, steps * world, seed=seed)[rank::world][:steps]


def _full(model, optimizer) -> dict:
    """The gathered model and optimizer state (every rank takes part; rank 0 keeps it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # on one rank these are the live tensors, not gathered copies: clone before the next step changes them
    return _clone({"model": msd, "optim": osd})


def _clone(node):
    if isinstance(node, torch.Tensor):
        return node.detach().clone()
    if isinstance(node, dict):
        return {k: _clone(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_clone(v) for v in node]
    return node


def _layout_state(layout: str, model, optimizer, scheduler, step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    if layout == "titan":
        msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
        losses = io.BytesIO()
        torch.save([1.0, 0.5], losses)
        return {**msd, "optimizer": osd, "lr_scheduler": scheduler.state_dict(),
                "dataloader": {"dp_rank_0": io.BytesIO(b"sampler-state")},
                "train_state": {"step": torch.tensor(step, dtype=torch.int32), "global_avg_losses": losses}}
    msd, osd = get_state_dict(model, optimizer)
    if layout == "lightning":
        return {"state_dict": msd, "optimizer_0": osd}
    return {"model": msd, "optim": osd, "sched": scheduler.state_dict(), "step": step}


def _save_worker(rank: int, world: int, folder: str, layout: str, tied: bool, vocab: int, steps: int) -> None:
    import torch.distributed.checkpoint as dcp

    model, optimizer, scheduler = _build(vocab, tied)
    for ids in _batches(vocab, steps, rank, world):
        assert math.isfinite(_step(model, optimizer, scheduler, ids))
    dcp.save(_layout_state(layout, model, optimizer, scheduler, steps), checkpoint_id=folder)
    full = _full(model, optimizer)
    if rank == 0:
        if layout == "lightning":  # what ModelParallelStrategy.save_checkpoint torch.saves beside the shards
            torch.save({"lr_schedulers": [scheduler.state_dict()], "global_step": steps, "epoch": 0},
                       Path(folder) / "meta.pt")
        torch.save({**full, "sched": scheduler.state_dict(), "step": steps}, f"{folder}.ref.pt")


def save_run(folder: Path, *, world: int, layout: str = "nested", tied: bool = False, vocab: int = 48,
             steps: int = 3) -> dict:
    """Train and save on `world` ranks; returns the reference (full state at save time)."""
    _spawn(_save_worker, world, str(folder), layout, tied, vocab, steps)
    return torch.load(f"{folder}.ref.pt", weights_only=True)


def _resume_worker(rank: int, world: int, folder: str, layout: str, tied: bool, vocab: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    model, optimizer, scheduler = _build(vocab, tied, seed=123)
    # a real optimizer step on zero grads gives AdamW its state tensors, so the template has them
    state = _layout_state(layout, model, optimizer, scheduler, 0)
    dcp.load(state, checkpoint_id=folder)
    if layout == "titan":
        msd = {k: v for k, v in state.items() if k not in ("optimizer", "lr_scheduler", "dataloader", "train_state")}
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=state["optimizer"],
                       options=StateDictOptions(flatten_optimizer_state_dict=True))
        scheduler.load_state_dict(state["lr_scheduler"])
        step = int(state["train_state"]["step"])
    elif layout == "lightning":
        set_state_dict(model, optimizer, model_state_dict=state["state_dict"], optim_state_dict=state["optimizer_0"])
        meta = torch.load(Path(folder) / "meta.pt", weights_only=True)
        scheduler.load_state_dict(meta["lr_schedulers"][0])
        step = meta["global_step"]
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        scheduler.load_state_dict(state["sched"])
        step = int(state["step"])
    loaded = _full(model, optimizer)
    lr = optimizer.param_groups[0]["lr"]
    ids = _batches(vocab, 1, rank, world, seed=99)[0]
    loss = _step(model, optimizer, scheduler, ids)
    after = _full(model, optimizer)
    if rank == 0:
        torch.save({"loaded": loaded, "after": after, "loss": loss, "step": step, "lr": lr,
                    "last_epoch": scheduler.last_epoch}, out)


def resume_run(folder: Path, *, world: int, layout: str = "nested", tied: bool = False, vocab: int = 48) -> dict:
    """Load `folder` on `world` ranks into a model built at `vocab` (dcp.load + set_state_dict), take one step."""
    out = f"{folder}.resume{world}.pt"
    _spawn(_resume_worker, world, str(folder), layout, tied, vocab, out)
    return torch.load(out, weights_only=True)
