"""`repair`: resize vocab tensors and their optimizer state, and write a safe resume checkpoint.

The output has the input's format (a `.pth` dict stays a `.pth` dict with the same keys, an HF
folder a folder with the same files) and records what was done: a `ckptfix` entry in the dict, or
a `ckptfix.json` sidecar for folders and bare state_dicts. The input is never modified.
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from ckptfix.errors import RepairError
from ckptfix.formats import read_checkpoint
from ckptfix.inspect import analyse
from ckptfix.io import BackgroundHash, check_output_path, output_target
from ckptfix.record import REPAIR_SCHEMA, Record, TokenizerRef
from ckptfix.surgery.options import RepairOptions
from ckptfix.surgery.plan import RepairPlan, make_plan
from ckptfix.surgery.undo import restore
from ckptfix.verify import VerifyFailed, undo_write, verify_output

RECORD_SCHEMA = REPAIR_SCHEMA
SHA256_PLACEHOLDER = "0" * 64


@dataclass
class RepairResult:
    """What `repair` planned and (unless dry_run) wrote. `to_json()` is the `--json` schema."""

    plan: RepairPlan
    output: str | None
    dry_run: bool
    record: dict[str, Any]
    backup: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        p = self.plan
        return {
            "schema": RECORD_SCHEMA,
            "source": p.ckpt.path,
            "format": p.ckpt.format,
            "output": self.output,
            "dry_run": self.dry_run,
            "policy": p.policy,
            "init": p.init,
            "target_rows": p.target_rows,
            "tokenizer": p.tokenizer.to_json(),
            "from_tokenizer": p.from_tokenizer.to_json() if p.from_tokenizer is not None else None,
            "changes": p.changes,
            "optimizer_state": "dropped" if p.drop_optimizer_state else ("remapped" if p.moments else "kept"),
            "scheduler_state": "reset" if p.reset_scheduler else "kept",
            "scaler_reset": p.reset_scaler,
            "rewarm": p.drop_optimizer_state and p.ckpt.optimizer is not None,
            "findings_before": [f.code for f in p.findings_before],
            "notes": p.notes + self.notes,
            "backup": self.backup,
            "audit": p.audit.to_json() if p.audit is not None else None,
        }


def repair(checkpoint: str | os.PathLike, tokenizer: str | os.PathLike, out: str | os.PathLike | None = None, *,
           from_tokenizer: str | os.PathLike | None = None, policy: str | None = None, init: str | None = None,
           std: float = 0.02, pad_to_multiple_of: int | None = None, dry_run: bool = False, force: bool = False,
           trust_pickle: bool = False, seed: int = 0, in_place: bool = False, keep_ids: bool = False,
           keep: Iterable[str] = (), own_rows: int | None = None,
           progress: Callable[[Iterable, int, str], Iterable] | None = None,
           options: RepairOptions | None = None) -> RepairResult:
    """Fit a checkpoint to `tokenizer` and write it to `out` in the same format.

    policy: "remap" (the default: every optimizer state follows its rows by what it means, or repair stops
    naming the states it cannot move, `ckptfix.optim_state`), "fresh" (drop
    optimizer state, keep the schedule position, the loop must re-warm) or "reset" (drop optimizer
    and scheduler state). init: "pieces" (the mean of the rows of the old tokenizer's pieces of each new
    token's text; the default when `from_tokenizer` is given), "mean" (HF mean_resizing; the default
    otherwise), "zeros" or "normal" (with `std`).
    `keep`: paths (as the audit prints them) that are not indexed by this tokenizer's ids: kept as they are.
    `own_rows`: the embedding's last rows the model class adds past its vocabulary (MllamaModel: 8), where no
    head tells (CKF107): kept past the tokens, rows = tokens + own_rows.
    `out` may equal the input only with `force`; the original is then kept as a `.bak`.
    `in_place` (DCP and sharded HF folders): rewrite only what changes inside the source folder, keeping
    the previous metadata/index as a backup that `ckptfix restore` puts back; `out` must then be omitted.
    `options`: all of the above as one `RepairOptions` value, instead of the keywords (not together with them).

    The stages, once each and in this order: read, analyse, plan, audit (every value that carries the old
    vocab size is changed, kept with a reason, or repair refuses: `ckptfix.audit`), write, verify (OUT read
    back and compared with the plan: `ckptfix.verify`; on a difference OUT is removed and VerifyFailed raised).
    """
    given = RepairOptions(from_tokenizer=from_tokenizer, policy=policy, init=init, std=std,
                          pad_to_multiple_of=pad_to_multiple_of, dry_run=dry_run, force=force,
                          trust_pickle=trust_pickle, seed=seed, in_place=in_place, keep_ids=keep_ids, keep=tuple(keep),
                          own_rows=own_rows, progress=progress)
    if options is not None and given != RepairOptions():
        raise TypeError("repair() takes its options either as options=RepairOptions(...) or as keywords, not both")
    return _repair_with(checkpoint, tokenizer, out, options if options is not None else given)


def _repair_with(checkpoint: str | os.PathLike, tokenizer: Any, out: str | os.PathLike | None,
                options: RepairOptions) -> RepairResult:
    """`repair` with its options as one value: to object storage, in place, or into a new local path."""
    if out is not None and not options.in_place and _is_url(out):  # staged here, then published (ckptfix.publish)
        from ckptfix.publish import repair_to_object_store

        return repair_to_object_store(_repair_with, os.fspath(checkpoint), tokenizer, os.fspath(out), options)
    if options.in_place and _is_url(checkpoint):  # written on the prefix's mirror, then published (ckptfix.publish)
        from ckptfix.publish import repair_in_place_in_object_store

        return repair_in_place_in_object_store(_repair_in_place, os.fspath(checkpoint), tokenizer, out, options)
    source = os.fspath(checkpoint)
    if "://" in str(source):  # a URL: read through its sparse local mirror (ckptfix.remote)
        from ckptfix.remote import local_path

        source = local_path(source)
    if options.in_place:
        return _repair_in_place(source, tokenizer, out, options)
    return _repair_into(source, tokenizer, out, options)


def _repair_into(source: str, tokenizer: Any, out: str | os.PathLike | None, options: RepairOptions) -> RepairResult:
    """Every stage into OUT, a new local path (or the input itself with `force`, keeping a `.bak`)."""
    dry_run, force = options.dry_run, options.force
    if not dry_run and out is not None:  # refused before anything is read, hashed or written
        check_output_path(source, os.fspath(out), force=force)
    # The source's sha256 (for the record) is the slowest part of a streamed repair: start it first,
    # so it runs while the checkpoint and tokenizer are read and planned, and then during the copy.
    writes = not dry_run and out is not None and (force or not os.path.lexists(os.fspath(out)))
    staged = _staged_for_object_store(source)
    if writes and not staged and "://" not in os.fspath(out):  # type: ignore[arg-type]
        _fetch_mirrored(source)
    paced = os.path.isfile(source)  # a single file is copied front to back: the hash can follow it
    new_hasher = (lambda: _NotHashed()) if staged else (lambda: BackgroundHash(source, paced=paced))
    hasher = new_hasher() if writes else None
    try:
        plan = _read_analyse_plan_audit(source, tokenizer, options)
        ckpt = plan.ckpt
        # looked up before --dry-run returns: a dry run never says "would write" for what the real run refuses
        writer = None if plan.is_noop() else _writer_for(ckpt.format, ckpt.path)
        if writer is not None and out is not None:
            writer = _writer_for_name(ckpt, os.fspath(out), writer)
        if dry_run:
            return RepairResult(plan, os.fspath(out) if out else None, True, build_record(plan, None))
        out, same_path = output_target(source, out, force=force)
        if writer is None:
            return RepairResult(plan, None, False, build_record(plan, None),
                                notes=["nothing to change: the checkpoint already fits the tokenizer; nothing written"])
        check_output_path(source, out, force=force, sidecar=_writes_sidecar(ckpt))
        if hasher is None:  # `out` existed at the first check and is gone now
            hasher = new_hasher()
        def record_fn(final: bool = True) -> dict[str, Any]:
            # not final: the record as it will be, the hash a placeholder of the same length (writers that
            # must place the record before the copy rewrite it in place once the copy is hashed)
            hashed = final or isinstance(hasher, _NotHashed)
            return build_record(plan, hasher.result() if hashed else SHA256_PLACEHOLDER)

        backup = writer(plan, out, record_fn, rng=np.random.default_rng(options.seed), in_place=same_path,
                        progress=options.progress)
        _verify(plan, out, options.trust_pickle, lambda: undo_write(out, backup, same_path=same_path,
                                                                    sidecar=f"{out}.ckptfix.json" if _writes_sidecar(ckpt) else None))
        return RepairResult(plan, out, False, build_record(plan, hasher.result()), backup=backup)
    finally:
        if hasher is not None:  # stop it pacing itself behind a copy that is not coming
            hasher.release()


def _is_url(path: Any) -> bool:
    """Whether `path` names object storage (`ckptfix.remote`, imported only when it may)."""
    if "://" not in str(os.fspath(path)):
        return False
    from ckptfix.remote import is_url

    return is_url(path)


class _NotHashed:
    """The hash of a mirrored source repaired into object storage: not computed, since it would fetch every
    byte the server-side copies leave in the store (the record's source_sha256 is null, as for --in-place)."""

    def result(self) -> None:
        return None

    def release(self) -> None:
        pass


def _staged_for_object_store(source: str) -> bool:
    """Whether `source` is a mirror being repaired into object storage (`ckptfix.publish` records its copies)."""
    remote = sys.modules.get("ckptfix.remote")
    return remote is not None and remote.is_mirrored(source) and remote.recording()


def _fetch_mirrored(source: str) -> None:
    """A source in object storage (`ckptfix.remote`) repaired into a local OUT: every byte is hashed for the
    record and copied or rewritten, so all of it is fetched first (bounded requests, into the private
    mirror), and the writers, the hash and the copies then read local bytes only."""
    remote = sys.modules.get("ckptfix.remote")
    if remote is not None:
        remote.fetch_all(source)


def _named(path: str) -> str:
    """A path as a record names it: absolute, or the URL of an object-store input."""
    remote = sys.modules.get("ckptfix.remote")
    return remote.source_name(path) if remote is not None else os.path.abspath(path)


def _spelled(text: str) -> str:
    """A note as a record keeps it: an object-store input's private mirror path spelled as its URL (the old
    tokenizer an HF folder holds is a path in the mirror), as the CLI prints it."""
    remote = sys.modules.get("ckptfix.remote")
    return remote.shown(text) if remote is not None else text


def _read_analyse_plan_audit(source: str, tokenizer: Any, options: RepairOptions,
                             formats: tuple[str, ...] | None = None) -> RepairPlan:
    """The stages before writing: read, analyse, plan, audit (a refusal naming every value nobody accounts
    for). `formats`: the formats this repair accepts (--in-place), checked as soon as the checkpoint is read."""
    from ckptfix.audit import audit
    from ckptfix.tokenizers import load_tokenizer

    ckpt = read_checkpoint(source, trust_pickle=options.trust_pickle)
    if formats is not None and ckpt.format not in formats:
        raise RepairError(f"--in-place supports {', '.join(formats)} folders, not {ckpt.format}; "
                          "repair into a new path with -o")
    tok = load_tokenizer(tokenizer)
    old_tok = load_tokenizer(options.from_tokenizer) if options.from_tokenizer is not None else None
    report = analyse(ckpt, tok, from_tokenizer=old_tok, own_rows=options.own_rows)
    plan = make_plan(report, tok, old_tok, options=options)
    if not plan.is_noop():  # a format repair cannot write says so first (DeepSpeed ZeRO: the conversion command)
        _writer_for(ckpt.format, ckpt.path)
    result = audit(plan, report.mapping)
    if result.unresolved:
        raise RepairError(result.refusal(ckpt.path))
    plan.audit = result
    return plan


def _verify(plan: RepairPlan, out: str, trust_pickle: bool, undo: Callable[[], str]) -> None:
    """OUT read back and compared with the plan; on a difference, what was written is taken back."""
    try:
        verify_output(plan, out, trust_pickle=trust_pickle)
    except VerifyFailed as exc:
        done = undo()
        raise VerifyFailed(f"{exc}; {done}") from None


IN_PLACE_FORMATS = ("dcp", "megatron", "hf-model", "hf-trainer")


def _in_place_writer(fmt: str) -> Callable[..., str | None]:
    if fmt == "dcp":
        from ckptfix.surgery.write_dcp import write_dcp_folder

        return lambda *args, **kw: write_dcp_folder(*args, incremental=True, **kw)
    if fmt == "megatron":
        from ckptfix.surgery.write_megatron import write_megatron_folder

        return lambda *args, **kw: write_megatron_folder(*args, incremental=True, **kw)
    from ckptfix.surgery.write_hf_inplace import write_hf_in_place

    return write_hf_in_place


def _repair_in_place(source: str, tokenizer: Any, out: Any, options: RepairOptions) -> RepairResult:
    """Only what changes is written, into the source itself. The source is not hashed for the record
    (that would read the whole folder, the cost in-place exists to avoid)."""
    if out is not None and os.path.abspath(os.fspath(out)) != os.path.abspath(source):
        raise RepairError("--in-place writes into the checkpoint itself; drop -o/--out")
    from ckptfix.surgery.undo import finish_interrupted

    dry_run = options.dry_run
    undone = [] if dry_run or not os.path.isdir(source) else finish_interrupted(source)  # before it is read
    plan = _read_analyse_plan_audit(source, tokenizer, options, formats=IN_PLACE_FORMATS)
    plan.notes[:0] = undone
    ckpt = plan.ckpt
    writer = None if plan.is_noop() else _in_place_writer(ckpt.format)
    if dry_run or writer is None:
        notes = [] if dry_run else ["nothing to change: the checkpoint already fits the tokenizer; nothing written"]
        return RepairResult(plan, source if dry_run else None, dry_run, build_record(plan, None), notes=notes)
    backup = writer(plan, source, lambda: build_record(plan, None), rng=np.random.default_rng(options.seed),
                    in_place=True, progress=options.progress)
    _verify(plan, source, options.trust_pickle, lambda: "the folder was put back (" + "; ".join(restore(source)) + ")")
    return RepairResult(plan, source, False, build_record(plan, None), backup=backup)


def _writes_sidecar(ckpt: Any) -> bool:
    """Whether the record goes beside OUT as `OUT.ckptfix.json` (a safetensors file, a bare state_dict)."""
    return ckpt.format == "safetensors" or (ckpt.format in ("torch", "lightning") and ckpt.sections.get("model") == "")


_TORCH_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt", ".tar")
_STATE_DICT_SUFFIXES = (".pth", ".pt", ".bin")


def _writer_for_name(ckpt: Any, out: str, writer: Callable[..., str | None]) -> Callable[..., str | None]:
    """The writer for the format OUT's name asks for: the input's own; a torch.save state_dict for a
    `.safetensors` input named .pth/.pt/.bin; a `.safetensors` file for a bare state_dict named so. A name
    that promises bytes repair cannot write is refused, never silently given other bytes (a .safetensors
    file that safetensors cannot open)."""
    fmt, name = ckpt.format, out.lower().rstrip("/")
    if fmt in ("torch", "lightning") and name.endswith(".safetensors"):
        from ckptfix.surgery.write_hf import safetensors_refusal, write_safetensors_from_torch

        why = safetensors_refusal(ckpt)
        if why is None:
            return write_safetensors_from_torch
        raise RepairError(f"{out}: a .safetensors name asks for safetensors bytes, but {why}. Name the output "
                          ".pth, .pt or .bin (or .ckpt): repair then writes it back as torch.save does")
    if fmt == "safetensors" and name.endswith(_STATE_DICT_SUFFIXES):
        from ckptfix.surgery.write_torch import write_torch_from_safetensors

        return write_torch_from_safetensors
    if fmt == "safetensors" and name.endswith(_TORCH_SUFFIXES):
        raise RepairError(f"{out}: a {os.path.splitext(name)[1]} name would promise a Lightning/training "
                          "checkpoint; from a .safetensors input repair writes .safetensors, or a torch.save "
                          "state_dict named .pth, .pt or .bin")
    return writer


def _writer_for(fmt: str, path: str | None = None):
    """The repair writer of format `fmt` (`ckptfix.formats.FORMATS`), or a RepairError saying why not."""
    from ckptfix.formats import BY_NAME, resolve

    spec = BY_NAME.get(fmt)
    if spec is not None and spec.write is not None:
        return resolve(spec.write)
    if spec is not None and spec.refuse is not None and path is not None:
        raise RepairError(resolve(spec.refuse)(path))
    if fmt == "deepspeed":  # ZeRO partitions need DeepSpeed's own universal-checkpoint conversion
        raise RepairError("repair does not support DeepSpeed checkpoints; convert them with DeepSpeed's "
                          "universal-checkpoint tool (python -m deepspeed.checkpoint.ds_to_universal)")
    raise RepairError(f"repair does not support the {fmt} format yet; inspect it, or convert it to a .pth first")


def build_record(plan: RepairPlan, source_sha256: str | None) -> dict[str, Any]:
    """The record written into the output (or its sidecar), as JSON: `Record.to_json` of `plan_record`."""
    return plan_record(plan, source_sha256).to_json()


def plan_record(plan: RepairPlan, source_sha256: str | None) -> Record:
    """What this repair did, for the output's record: provenance, plus the facts a later run acts on
    (the tokenizer the rows now belong to, the optimizer's parameter names when all are known)."""
    from ckptfix.mapping import map_optimizer
    from ckptfix.version import __version__

    mapping = map_optimizer(plan.ckpt)
    indices = plan.ckpt.optimizer.indices() if plan.ckpt.optimizer is not None else []
    names = [mapping.names.get(i) for i in indices]
    complete = bool(indices) and all(isinstance(n, str) for n in names)
    provenance = {
        "version": __version__,
        "created": _created().isoformat(timespec="seconds"),
        "source": _named(plan.ckpt.path),
        "source_sha256": source_sha256,
        "format": plan.ckpt.format,
        "policy": plan.policy,
        "init": plan.init,
        "target_rows": plan.target_rows,
        "rows_moved_by": plan.rows_by,
        "changes": plan.changes,
        "scaler_reset": plan.reset_scaler,
        "notes": [_spelled(note) for note in plan.notes],
    }
    return Record(
        REPAIR_SCHEMA,
        param_names=[str(n) for n in names] if complete else None,
        param_names_method=mapping.method if complete else None,
        tokenizer=_tokenizer_ref(plan.tokenizer),
        from_tokenizer=_tokenizer_ref(plan.from_tokenizer) if plan.from_tokenizer is not None else None,
        rewarm=bool(plan.drop_optimizer_state and plan.ckpt.optimizer is not None),
        optimizer_state="dropped" if plan.drop_optimizer_state else "remapped" if plan.moments else "kept",
        scheduler_state="reset" if plan.reset_scheduler else "kept",
        provenance=provenance,
    )


def _created() -> datetime.datetime:
    """Now, or the time SOURCE_DATE_EPOCH names (the reproducible-builds convention): two repairs of the same
    input then write the same bytes (the tests compare a repair published to object storage with a local one)."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "")
    if epoch.isdigit() and len(epoch) <= 12:
        return datetime.datetime.fromtimestamp(int(epoch), datetime.timezone.utc)
    return datetime.datetime.now(datetime.timezone.utc)


def _tokenizer_ref(tok: Any) -> TokenizerRef:
    from ckptfix.identity import fingerprint

    return TokenizerRef(_named(tok.path), tok.size, fingerprint(tok))

