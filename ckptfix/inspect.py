"""`inspect`: read a checkpoint's metadata, compare it with a tokenizer, and list findings."""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ckptfix.checkpoint import Checkpoint
from ckptfix.checks import Context, Finding, run_checks
from ckptfix.errors import UnreadableCheckpoint, UnrecognisedFolder
from ckptfix.formats import read_checkpoint
from ckptfix.mapping import ParamMapping, map_optimizer
from ckptfix.plain import plain
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
    audit: Any = None  # ckptfix.audit.Audit of the plan repair would make (inspect with a tokenizer)
    # `identity.known_old_tokenizer`'s answer (old tokenizer, notes), asked once per run: None without a tokenizer
    identity: tuple | None = None

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
        remote = sys.modules.get("ckptfix.remote")  # an input in object storage: its URL, not the mirror's path
        return remote.shown_tree(self._to_json()) if remote is not None else self._to_json()

    def _to_json(self) -> dict[str, Any]:
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
            "audit": self.audit.to_json() if self.audit is not None else None,
            "findings": [f.to_json() for f in self.findings],
            "summary": self.counts(),
        }


def inspect(path: str | os.PathLike, tokenizer: str | os.PathLike | None = None, *, scan: bool = False,
            verify: bool = False, trust_pickle: bool = False, from_tokenizer: str | os.PathLike | None = None,
            progress: Callable[[Iterable, int, str], Iterable] | None = None, resume: Any = None) -> Report:
    """Inspect a checkpoint (file or folder) against an optional tokenizer.

    `from_tokenizer`: the tokenizer the checkpoint was trained with, when neither a ckptfix record nor
    the folder's own tokenizer files say so; with it, tokens whose id moved are reported.
    Reads metadata only (zip directory + pickle, safetensors header, JSON indexes) unless `scan`
    (NaN/Inf in every tensor) or `verify` (zip CRCs) ask for tensor bytes. Never executes pickle code.
    `resume`: a `ckptfix.data_position.ResumeWith`, the batch size, grad accumulation and processes a Trainer resume
    will use: CKF314 says where it starts in the data and the LR schedule when samples per step change.
    """
    ckpt = _read_one_checkpoint(os.fspath(path), trust_pickle)
    tok = old = None
    if tokenizer is not None or from_tokenizer is not None:
        from ckptfix.tokenizers import load_tokenizer

        tok = load_tokenizer(tokenizer) if tokenizer is not None else None
        old = load_tokenizer(from_tokenizer) if from_tokenizer is not None else None
    report = analyse(ckpt, tok, scan=scan, verify=verify, progress=progress, from_tokenizer=old, resume=resume)
    _add_audit(report)
    return report


def _read_one_checkpoint(path: str, trust_pickle: bool) -> Checkpoint:
    """The checkpoint at `path`; a run's output folder (checkpoint-N/, step-N/, *.ckpt inside) is refused
    naming its newest whole checkpoint, as `ckptfix latest` finds it."""
    try:
        return read_checkpoint(path, trust_pickle=trust_pickle)
    except UnrecognisedFolder:
        from ckptfix.latest import run_folder_message

        message = run_folder_message(path)
        if message is None:
            raise
        raise UnreadableCheckpoint(message) from None


def _add_audit(report: Report) -> None:
    """Values that carry the old vocab size and that the plan repair would make does not account for
    (CKF130-CKF133, `ckptfix.audit`): findings, in the report's order."""
    from ckptfix.audit import findings
    from ckptfix.checks import SEVERITIES

    report.audit = _plan_audit(report)
    made = findings(report.audit)
    if made:
        order = {s: i for i, s in enumerate(SEVERITIES)}
        report.findings = sorted(report.findings + made, key=lambda f: (order[f.severity], f.code))


def _plan_audit(report: Report) -> Any:
    """For inspect: the audit of the plan repair would make with its defaults (`--init mean`: the same rows,
    no pieces spelled). None without a tokenizer, or when repair would refuse anyway (inspect says why)."""
    if report.tokenizer is None or not report.vocab:
        return None  # before the imports: the surgery package imports numpy, which inspect of metadata never needs
    from ckptfix.audit import audit
    from ckptfix.errors import CkptfixError
    from ckptfix.surgery.options import RepairOptions
    from ckptfix.surgery.plan import make_plan

    old = report.old_tokenizer
    try:
        plan = make_plan(report, report.tokenizer, old.info if old is not None and old.origin == "given" else None,
                         RepairOptions(init="mean"), format_notes=False)
    except CkptfixError:
        return None
    return audit(plan, report.mapping)


def _unread_in_object_storage(ckpt: Checkpoint, scan: bool) -> list[str]:
    """What the reader left unread in object storage, a request each: records it did not open
    (`dcp_folder._opened_when_read`) and per-parameter steps (`common.read_steps`). `--scan` reads every
    tensor, and so each of them; else a note each, so a check's silence is not taken for all of them."""
    from ckptfix.formats.common import read_steps

    opt, notes = ckpt.optimizer, []
    if ckpt.unopened_records and not scan:
        notes.append(f"object storage: {ckpt.unopened_records} tensor record(s) were not opened (a request each): "
                     "their shapes and dtypes are the metadata's, and each record is checked when its rows are read "
                     "(repair, --scan)")
    if opt is not None and opt.unread_steps and scan:
        opt.unread_steps = read_steps(opt.unread_steps, everything=True)
    elif opt is not None and opt.unread_steps:
        read = sum(1 for ps in opt.state.values() if ps.step is not None)
        notes.append(f"object storage: the step of {len(opt.unread_steps)} of {len(opt.state)} parameters was not "
                     f"read (each lies among the moments: a request each); the step checks saw the {read} read from "
                     "both ends of the state (the embedding's and the head's in most models); --scan reads every one")
    return notes


def analyse(ckpt: Checkpoint, tokenizer: Any = None, *, scan: bool = False, verify: bool = False,
            progress: Callable | None = None, from_tokenizer: Any = None, own_rows: int | None = None,
            resume: Any = None) -> Report:
    """Run every check on an already-read checkpoint (repair and the guard reuse this). `own_rows`: repair's
    `--own-rows` (`vocab.declare_own_rows`); `resume`: as `inspect`'s."""
    from ckptfix.identity import identity_notes, known_old_tokenizer

    mapping = map_optimizer(ckpt)
    notes: list[str] = _unread_in_object_storage(ckpt, scan)
    vocab = find_vocab_tensors(ckpt, mapping, tokenizer.size if tokenizer is not None else None, notes, own_rows)
    old, identity = None, None
    if tokenizer is not None or from_tokenizer is not None:
        identity = old, known = known_old_tokenizer(ckpt, vocab_rows(vocab), from_tokenizer)
        notes += known + identity_notes(ckpt, tokenizer, old, vocab_rows(vocab))
    if resume is not None:
        from ckptfix.data_position import notes as position_notes

        notes += position_notes(ckpt, resume)
    ctx = Context(ckpt, mapping, vocab, tokenizer, scan=scan, verify=verify, progress=progress, old_tokenizer=old,
                  resume=resume)
    return Report(ckpt, mapping, vocab, run_checks(ctx), tokenizer, notes, old, identity=identity)



def weights_only_summary(ckpt: Checkpoint) -> dict[str, Any]:
    """Which globals keep `torch.load(weights_only=True)` from loading the file, and each object built from
    them: its path, class, fields as data, and whether `ckptfix convert` can turn it into plain values."""
    from ckptfix.formats.data_globals import raw_uses

    found = raw_uses(ckpt)
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
