"""`inspect`: read a checkpoint's metadata, compare it with a tokenizer, and list findings."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ckptfix.checkpoint import Checkpoint, TensorInfo
from ckptfix.checks import Context, Finding, run_checks
from ckptfix.formats import read_checkpoint
from ckptfix.formats.pickle_safe import OpaqueObject, RebuiltTensor, TensorRef, TorchDevice, TorchDtype, TorchLayout
from ckptfix.mapping import ParamMapping, map_optimizer
from ckptfix.vocab import VocabTensor, find_vocab_tensors, tied_head_missing, vocab_rows

SCHEMA = "ckptfix.inspect/1"


@dataclass
class Report:
    """What `ckptfix inspect` found. `to_json()` is the documented, stable `--json` schema."""

    ckpt: Checkpoint
    mapping: ParamMapping
    vocab: list[VocabTensor]
    findings: list[Finding]
    tokenizer: Any = None
    notes: list[str] = field(default_factory=list)
    old_tokenizer: Any = None  # identity.OldTokenizer: the tokenizer the rows belong to, when known

    @property
    def exit_code(self) -> int:
        return 1 if any(f.severity == "error" for f in self.findings) else 0

    def select(self, select: Iterable[str] = (), ignore: Iterable[str] = ()) -> None:
        """Keep the findings whose code starts with one of `select` (all if empty) and none of `ignore`,
        as ruff's --select/--ignore do; the exit code then follows the findings kept."""
        keep, drop = tuple(c.upper() for c in select), tuple(c.upper() for c in ignore)
        self.findings = [f for f in self.findings
                         if (not keep or f.code.startswith(keep)) and not (drop and f.code.startswith(drop))]

    def counts(self) -> dict[str, int]:
        c = Counter(f.severity for f in self.findings)
        return {s: c.get(s, 0) for s in ("error", "warning", "info")}

    def to_json(self) -> dict[str, Any]:
        ckpt = self.ckpt
        return {
            "schema": SCHEMA,
            "path": ckpt.path,
            "format": ckpt.format,
            "model": model_summary(ckpt),
            "optimizer": optimizer_summary(ckpt, self.mapping),
            "scheduler": scheduler_summary(ckpt),
            "scaler": scaler_summary(ckpt),
            "vocab": {
                "tokenizer": self.tokenizer.to_json() if self.tokenizer is not None else None,
                "tensors": [v.to_json() for v in self.vocab],
                "tied_head_not_stored": tied_head_missing(ckpt),
            },
            "extras": {str(k): plain(v) for k, v in ckpt.extras.items()},
            "weights_only": weights_only_summary(ckpt),
            "record": ckpt.record.to_json() if ckpt.record is not None else None,
            "notes": ckpt.notes + self.notes,
            "findings": [f.to_json() for f in self.findings],
            "summary": self.counts(),
        }


def inspect(path: str | os.PathLike, tokenizer: str | os.PathLike | None = None, *, scan: bool = False,
            verify: bool = False, trust_pickle: bool = False, from_tokenizer: str | os.PathLike | None = None,
            progress: Callable[[Iterable, int, str], Iterable] | None = None) -> Report:
    """Inspect a checkpoint (file or folder) against an optional tokenizer.

    `from_tokenizer`: the tokenizer the checkpoint was trained with, when neither a ckptfix record nor
    the folder's own tokenizer files say so; with it, tokens whose id moved are reported.
    Reads metadata only (zip directory + pickle, safetensors header, JSON indexes) unless `scan`
    (NaN/Inf in every tensor) or `verify` (zip CRCs) ask for tensor bytes. Never executes pickle code.
    """
    ckpt = read_checkpoint(path, trust_pickle=trust_pickle)
    tok = old = None
    if tokenizer is not None or from_tokenizer is not None:
        from ckptfix.tokenizers import load_tokenizer

        tok = load_tokenizer(tokenizer) if tokenizer is not None else None
        old = load_tokenizer(from_tokenizer) if from_tokenizer is not None else None
    return analyse(ckpt, tok, scan=scan, verify=verify, progress=progress, from_tokenizer=old)


def analyse(ckpt: Checkpoint, tokenizer: Any = None, *, scan: bool = False, verify: bool = False,
            progress: Callable | None = None, from_tokenizer: Any = None) -> Report:
    """Run every check on an already-read checkpoint (repair and the guard reuse this)."""
    from ckptfix.identity import identity_notes, known_old_tokenizer

    mapping = map_optimizer(ckpt)
    notes: list[str] = []
    vocab = find_vocab_tensors(ckpt, mapping, tokenizer.size if tokenizer is not None else None, notes)
    old = None
    if tokenizer is not None or from_tokenizer is not None:
        old, known = known_old_tokenizer(ckpt, vocab_rows(vocab), from_tokenizer)
        notes += known + identity_notes(ckpt, tokenizer, old, vocab_rows(vocab))
    ctx = Context(ckpt, mapping, vocab, tokenizer, scan=scan, verify=verify, progress=progress, old_tokenizer=old)
    return Report(ckpt, mapping, vocab, run_checks(ctx), tokenizer, notes, old)



def weights_only_summary(ckpt: Checkpoint) -> dict[str, Any]:
    """Which globals keep `torch.load(weights_only=True)` from loading the file, and each object built from
    them: its path, class, fields as data, and whether `ckptfix convert` can turn it into plain values."""
    from ckptfix.formats.data_globals import uses

    found = uses(ckpt.raw) if ckpt.raw is not None else []
    return {"refused_globals": sorted({g for u in found for g in u.torch_refuses}),
            "objects": [u.to_json() for u in found]}


def model_summary(ckpt: Checkpoint) -> dict[str, Any]:
    unique = [t for n, t in ckpt.model.items() if n not in ckpt.tied]
    dtypes = Counter(t.dtype for t in unique)
    return {
        "tensors": len(ckpt.model),
        "parameters": sum(t.numel for t in unique),
        "bytes": sum(t.nbytes for t in unique),
        "dtypes": dict(dtypes.most_common()),
        "tied": dict(ckpt.tied),
        "section": ckpt.sections.get("model"),
    }


def optimizer_summary(ckpt: Checkpoint, mapping: ParamMapping) -> dict[str, Any] | None:
    opt = ckpt.optimizer
    if opt is None:
        return None
    steps = sorted({ps.step for ps in opt.state.values() if ps.step is not None})
    groups = []
    for g in opt.groups:
        options = {k: plain(v) for k, v in g.options.items()
                   if k in ("lr", "initial_lr", "betas", "eps", "weight_decay", "momentum", "amsgrad")}
        options["lr"] = g.lr
        groups.append({"params": len(g.params), **options})
    state_keys = Counter(k for ps in opt.state.values() for k in ps.tensors)
    return {
        "type": opt.kind,
        "param_groups": groups,
        "params": len(opt.indices()),
        "params_with_state": len(opt.state),
        "state_keys": dict(state_keys),
        "step": steps[-1] if len(steps) == 1 else steps,
        "mapping": mapping.method,
        "state_bytes": sum(t.nbytes for _, _, t in opt.tensors()),
        "section": ckpt.sections.get("optimizer"),
    }


def scheduler_summary(ckpt: Checkpoint) -> dict[str, Any] | None:
    sched = ckpt.scheduler
    if sched is None:
        return None
    keys = ("last_epoch", "_step_count", "base_lrs", "_last_lr", "total_steps", "T_max", "step_size", "warmup_steps")
    out = {k.lstrip("_"): plain(sched[k]) for k in keys if k in sched}
    out["type"] = _scheduler_type(sched)
    out["section"] = ckpt.sections.get("scheduler")
    return out


def _scheduler_type(sched: dict) -> str:
    if "lr_lambdas" in sched:
        return "LambdaLR/MultiplicativeLR"
    if "total_steps" in sched and "anneal_func" in sched or "_anneal_func_type" in sched:
        return "OneCycleLR"
    if "T_max" in sched:
        return "CosineAnnealingLR"
    if "step_size" in sched:
        return "StepLR"
    if "_schedulers" in sched:
        return "SequentialLR/ChainedScheduler"
    return "unknown"


def scaler_summary(ckpt: Checkpoint) -> dict[str, Any] | None:
    if ckpt.scaler is None:
        return None
    out = {k.lstrip("_"): plain(v) for k, v in ckpt.scaler.items()}
    out["enabled"] = bool(ckpt.scaler)
    out["section"] = ckpt.sections.get("scaler")
    return out


def plain(value: Any) -> Any:
    """A JSON-safe summary of a checkpoint value (tensors become shape/dtype descriptions).

    Bounded: at most `PLAIN_BUDGET` nodes per value, so a memo-shared pickle DAG (which a naive walk
    expands exponentially) summarises in linear time."""
    return _plain(value, 0, [PLAIN_BUDGET])


PLAIN_BUDGET = 2000


def _plain(value: Any, depth: int, budget: list[int]) -> Any:
    budget[0] -= 1
    if isinstance(value, (TensorInfo, TensorRef)):
        return {"tensor": list(value.shape), "dtype": value.dtype}
    if isinstance(value, RebuiltTensor):  # sparse, nested, meta
        return {"tensor": list(value.shape) if value.shape is not None else None, "dtype": value.dtype,
                "kind": value.kind}
    if isinstance(value, (TorchDtype, TorchDevice, TorchLayout)):
        return repr(value)
    if isinstance(value, OpaqueObject):
        return {"object": value.cls}
    if isinstance(value, float) and value != value:
        return "nan"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth > 3 or budget[0] <= 0:
        return f"<{type(value).__name__}>"
    if isinstance(value, dict):
        items = list(value.items())
        out = {str(k): _plain(v, depth + 1, budget) for k, v in items[:50]}
        if len(items) > 50:
            out["..."] = f"{len(items) - 50} more"
        return out
    if isinstance(value, (list, tuple, set, frozenset)):
        seq = list(value)
        listed = [_plain(v, depth + 1, budget) for v in seq[:20]]
        return listed + [f"... {len(seq) - 20} more"] if len(seq) > 20 else listed
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    return repr(value)[:80]
