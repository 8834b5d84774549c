"""The guard on real ranks: gloo on CPU, a TinyLM under `fully_shard` (FSDP2) or DDP, real AdamW steps.

`run(kind, world, folder)` forks `world` ranks (`fsdp_factory._spawn`: every rank killed on any outcome,
bounded by a timeout) and returns each rank's report (a JSON file per rank). Each rank:

- trains `STEPS` steps on token ids below `LOW`, so under FSDP2 the embedding rows past them (the last
  rank's shard of a 1003-row table) get an all-zero gradient on that rank only, with a `StepProbe`
  (`healthy`);
- puts NaN into one embedding row (rank 0's shard; only rank 0's batch uses that token) and probes one step
  (`nan`), with the expected non-finite counts taken from the gathered gradients (`full_tensor()`, issued
  alike on every rank, outside what is counted);
- first, `verify_loaded` against the checkpoint saved before wrapping (healthy), against one with fewer
  rows, and after a change to a row of the last rank's shard (FSDP2; DDP: of one replica); under FSDP2
  `ResumeGuard.load` (refused alike on every rank);
- counts the collectives of every guard call (`collectives.count`), and of a deliberately data-dependent
  call (`hazard`: torch.equal only where the local gradient is non-zero, the old probe's pattern) to show
  that the counter sees the difference that hangs a run.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from ckpt_factory import TinyLM, lm_loss
from collectives import count
from fsdp_factory import _spawn

from ckptfix.guard import ResumeGuard, StepProbe
from ckptfix.guard.ranks import ShardedUnsupported, local

VOCAB, LOW, STEPS, NAN_TOKEN = 1003, 400, 3, 5


def _wrap(model: TinyLM, kind: str):
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def _batch(rank: int, seed: int, low: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randint(low, LOW, (4, 9), generator=g)


def _probed_steps(model, optimizer, probe: StepProbe, batches, calls: list[list[str]]) -> None:
    for ids in batches:
        optimizer.zero_grad(set_to_none=True)
        lm_loss(model, ids).backward()
        for hook in (probe.after_backward, probe.before_step, optimizer.step, probe.after_step):
            if hook is optimizer.step:
                hook()
            else:
                calls.append(count(hook)[1])


def _nonfinite(model) -> dict[str, list[int]]:
    """Every gradient's non-finite count over the whole tensor, gathered on every rank alike."""
    out = {}
    for name, p in model.named_parameters():
        whole = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        bad = int((~torch.isfinite(whole)).sum())
        if bad:
            out[name] = [bad, whole.numel()]
    return out


def _hazard(model) -> list[str]:
    """The old probe's pattern: a collective only where this rank's gradient piece is non-zero."""
    def pattern():
        for p in model.parameters():
            if p.grad is not None and bool(local(p.grad).any()):
                torch.equal(p.detach(), p.detach())
    return count(pattern, dry=True)[1]  # dry: counted, not issued (issued, it would hang here)


def _worker(rank: int, world: int, folder: str, kind: str) -> None:
    warnings.simplefilter("ignore")
    out: dict = {"rank": rank}
    torch.manual_seed(0)
    model = TinyLM(VOCAB, dim=16, layers=2)
    ckpt, short = f"{folder}/whole.pt", f"{folder}/short.pt"
    if rank == 0:  # the checkpoint verify_loaded compares with: the same weights, saved before sharding
        torch.save(model.state_dict(), ckpt)
        torch.save({k: v[:1000] if v.shape[0] == VOCAB else v for k, v in model.state_dict().items()}, short)
    dist.barrier()
    model = _wrap(model, kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    embedding = model.text_embedding.weight if kind == "fsdp" else model.module.text_embedding.weight

    guard = ResumeGuard(model, optimizer)
    for case, path in (("verify_healthy", ckpt), ("verify_short", short)):
        out[case], out[f"{case}_calls"] = _findings(count(guard.verify_loaded, path, raise_on_error=False))
    with torch.no_grad():  # a row of the last rank's shard (FSDP2; DDP: the last row) no longer the checkpoint's
        kept = local(embedding)[-1].clone()
        if rank == world - 1:
            local(embedding)[-1] += 1.0
        out["verify_changed"], out["verify_changed_calls"] = _findings(count(
            guard.verify_loaded, ckpt, raise_on_error=False))
        local(embedding)[-1] = kept
    if kind == "fsdp":
        out["load"], out["load_calls"] = _refusal(guard, ckpt)

    probe = StepProbe(model, optimizer, raise_on_error=False)
    out["healthy_calls"] = []
    _probed_steps(model, optimizer, probe, [_batch(rank, s) for s in range(STEPS)], out["healthy_calls"])
    out["healthy"] = [str(p) for p in probe.problems]
    out["zero_shard"] = [not bool(local(p.grad).any()) for p in [embedding]]
    out["hazard_calls"] = _hazard(model)

    with torch.no_grad():
        if rank == 0 or kind == "ddp":
            local(embedding)[NAN_TOKEN] = math.nan  # rank 0's shard (rows 0..501); DDP: every replica alike
    probe = StepProbe(model, optimizer, steps=1, raise_on_error=False)
    optimizer.zero_grad(set_to_none=True)
    ids = _batch(rank, 9, low=NAN_TOKEN + 1)
    if rank == 0:
        ids[0, 0] = NAN_TOKEN
    lm_loss(model, ids).backward()
    out["nan_expected"] = _nonfinite(model)
    out["nan_calls"] = [count(probe.after_backward)[1], count(probe.before_step)[1]]
    optimizer.step()
    out["nan_calls"].append(count(probe.after_step)[1])
    out["nan"] = [str(p) for p in probe.problems]
    out["nan_params"] = [list(p.params) for p in probe.problems if p.code == "CKF812"]
    Path(folder, f"rank{rank}.json").write_text(json.dumps(out))


def _findings(result) -> tuple[list[str], list[str]]:
    problems, calls = result
    return [str(p) for p in problems], calls


def _refusal(guard: ResumeGuard, path: str) -> tuple[str, list[str]]:
    def load() -> str:
        try:
            guard.load(path)
        except ShardedUnsupported as e:
            return f"{type(e).__name__}: {e}"
        return "loaded"
    message, calls = count(load)
    return str(message), calls


def run(kind: str, world: int, folder: Path, timeout: float = 120) -> list[dict]:
    """Each rank's report, rank 0 first."""
    folder.mkdir(parents=True, exist_ok=True)
    _spawn(_worker, world, str(folder), kind, timeout=timeout)
    return [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(world)]


def _resume_worker(rank: int, world: int, folder: str, out: str) -> None:
    """`ResumeGuard.load` of a DCP folder (fsdp_factory's nested layout, vocab 48) into a fresh FSDP2 model,
    policy strict, then one guarded step on fsdp_factory.resume_run's batch; and, at a grown vocab, remap."""
    from fsdp_factory import _batches, _build, _full

    warnings.simplefilter("ignore")
    model, optimizer, scheduler = _build(48, False, seed=123)
    guard = ResumeGuard(model, optimizer, scheduler, policy="strict")
    report, load_calls = count(guard.load, folder)
    loaded = _full(model, optimizer)  # gathered alike on every rank; rank 0 keeps it
    if rank == 0:
        torch.save({"loaded": loaded}, Path(out, "loaded.pt"))
    optimizer.zero_grad(set_to_none=True)
    loss = lm_loss(model, _batches(48, 1, rank, world, seed=99)[0])
    loss.backward()
    guard.before_step()
    optimizer.step()
    guard.after_step()
    scheduler.step()
    grown = _build(52, False, seed=123)
    outcome = _refusal(ResumeGuard(*grown, tokenizer=52, policy="remap"), folder)[0]
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "problems": [str(p) for p in report.problems], "actions": report.actions, "loss": float(loss),
        "load_calls": load_calls, "last_epoch": scheduler.last_epoch, "probe": [str(p) for p in guard.probe.problems] if guard.probe else None,
        "remap": outcome}))


def resume(world: int, folder: Path, out: Path, timeout: float = 120) -> list[dict]:
    """Each rank's report of `_resume_worker`, rank 0 first."""
    out.mkdir(parents=True, exist_ok=True)
    _spawn(_resume_worker, world, str(folder), str(out), timeout=timeout)
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
