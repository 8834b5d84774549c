"""Where a resumed Hugging Face Trainer run starts in the data and in its LR schedule (issue 42, topology).

The Trainer counts the resume position in optimizer steps, not samples (transformers 5.24,
`Trainer._init_training_state` and `_run_epoch`): with U = update steps per epoch *of the resumed run*, it
starts at epoch `global_step // U` and skips `(global_step % U) * gradient_accumulation_steps` batches of the
*new* per-process size (`skip_first_batches`). When samples per optimizer step (batch x grad accumulation x
processes) change between save and resume, that lands elsewhere than where the saved run stood: samples are
never trained, or trained twice. An epoch-driven run (max_steps unset) also rebuilds its LR schedule over
`ceil(num_train_epochs * U)` steps: the scheduler's step is restored, its length is not.

`saved_layout(ckpt)` reads what the checkpoint records (trainer_state.json, training_args.bin read statically,
the rng_state files); `position(saved, new)` is the arithmetic, pure. `checks/data_position.py` (CKF314) and the
Trainer callback both use it. Assumes plain data parallelism (no tensor/context/sequence parallel groups) and at
most one device per process.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any

_LENGTHLESS = sys.maxsize  # the Trainer's num_train_epochs for a dataset without __len__ (set_initial_training_values)
_MAX_LENGTHS = 200_000  # dataset lengths tried when only a range is known


@dataclass(frozen=True)
class Layout:
    """Samples per optimizer step: per-process batch x gradient accumulation x processes. None: not known."""

    batch_size: int | None
    grad_accum: int | None
    world_size: int | None

    @property
    def known(self) -> bool:
        return None not in (self.batch_size, self.grad_accum, self.world_size)

    @property
    def samples_per_step(self) -> int:
        assert self.batch_size and self.grad_accum and self.world_size
        return self.batch_size * self.grad_accum * self.world_size

    def describe(self) -> str:
        if not self.known:
            return "unknown"
        procs = "process" if self.world_size == 1 else "processes"
        return (f"{self.samples_per_step} (batch {self.batch_size} x grad accum {self.grad_accum} x "
                f"{self.world_size} {procs})")


@dataclass
class Saved:
    """What a Trainer checkpoint records about the run that saved it."""

    layout: Layout
    global_step: int | None = None
    epoch: float | None = None  # trainer_state.json: epoch + batches consumed / batches per epoch
    max_steps: int | None = None  # trainer_state.json: the schedule's length
    state_epochs: int | None = None  # trainer_state.json num_train_epochs (sys.maxsize: no dataset length)
    args_max_steps: int | None = None  # training_args.bin: > 0 fixes the schedule's length
    args_epochs: float | None = None
    scheduler_type: str | None = None
    scheduler_kwargs: dict[str, Any] = field(default_factory=dict)
    warmup: float | None = None  # warmup_steps: >= 1 steps, else a ratio of the schedule's length
    base_lr: float | None = None  # the scheduler's base_lrs[0]
    saved_lr: float | None = None  # param group 0's lr in optimizer.pt: the first resumed step runs at it
    learning_rate: float | None = None  # training_args.bin (polynomial decay's lr_init)
    drop_last: bool = False
    ignore_data_skip: bool = False
    history: list[tuple[int, float]] = field(default_factory=list)  # log_history's (step, epoch) pairs
    read: list[str] = field(default_factory=list)  # what was read, from where (for the notes)
    missing: list[str] = field(default_factory=list)  # what is needed and not recorded


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def saved_layout(ckpt: Any) -> Saved | None:
    """What a Trainer `checkpoint-N/` (a `Checkpoint` of format hf-trainer) records; None for other formats."""
    state = ckpt.extras.get("trainer_state")
    kind = getattr(ckpt, "format", None)
    # a PEFT model's Trainer checkpoint-N is read as peft-adapter, a full model's may be read as hf-model
    if kind != "hf-trainer" and not (kind in ("hf-model", "peft-adapter") and isinstance(state, dict)):
        return None
    args = ckpt.extras.get("training_args")
    files = ckpt.extras.get("trainer_files")
    state = state if isinstance(state, dict) else {}
    args = args if isinstance(args, dict) and "unreadable" not in args else {}
    rng = files.get("rng", []) if isinstance(files, dict) else _rng_files(ckpt.path)
    read, missing = [], []

    batch = _int(state.get("train_batch_size")) or _int(args.get("per_device_train_batch_size"))
    grad_accum = _int(args.get("gradient_accumulation_steps"))
    world = None
    if rng == ["rng_state.pth"]:
        world = 1
    elif rng and "rng_state.pth" not in rng:
        ranks = sorted(int(n[len("rng_state_"):-len(".pth")]) for n in rng)
        world = len(ranks) if ranks == list(range(len(ranks))) else None
    saved = Saved(Layout(batch, grad_accum, world))
    saved.global_step = _int(state.get("global_step"))
    saved.epoch = _num(state.get("epoch"))
    saved.max_steps = _int(state.get("max_steps"))
    saved.state_epochs = _int(state.get("num_train_epochs"))
    saved.args_max_steps = _int(args.get("max_steps"))
    saved.args_epochs = _num(args.get("num_train_epochs"))
    saved.scheduler_type = args.get("lr_scheduler_type") if isinstance(args.get("lr_scheduler_type"), str) else None
    kwargs = args.get("lr_scheduler_kwargs")
    saved.scheduler_kwargs = dict(kwargs) if isinstance(kwargs, dict) else {}
    saved.warmup = _num(args.get("warmup_steps"))
    saved.learning_rate = _num(args.get("learning_rate"))
    saved.drop_last = args.get("dataloader_drop_last") is True
    saved.ignore_data_skip = args.get("ignore_data_skip") is True
    sched = ckpt.scheduler if isinstance(ckpt.scheduler, dict) else {}
    base = sched.get("base_lrs")
    saved.base_lr = _num(base[0]) if isinstance(base, list) and base else None
    opt = ckpt.optimizer
    saved.saved_lr = _num(opt.groups[0].lr) if opt is not None and opt.groups else None
    history = state.get("log_history")
    if isinstance(history, list):
        for entry in history[:10_000]:
            if isinstance(entry, dict) and _int(entry.get("step")) and _num(entry.get("epoch")) is not None:
                saved.history.append((entry["step"], float(entry["epoch"])))

    if state:
        read.append(f"trainer_state.json: global_step {saved.global_step}, epoch {saved.epoch}, train_batch_size "
                    f"{state.get('train_batch_size')}, max_steps {saved.max_steps}")
    else:
        missing.append("trainer_state.json (global_step, train_batch_size)")
    if args:
        read.append(f"training_args.bin (statically): per_device_train_batch_size "
                    f"{args.get('per_device_train_batch_size')}, gradient_accumulation_steps {grad_accum}, max_steps "
                    f"{saved.args_max_steps}, num_train_epochs {args.get('num_train_epochs')}, lr_scheduler_type "
                    f"{saved.scheduler_type}, warmup_steps {args.get('warmup_steps')}")
    else:
        missing.append("training_args.bin (gradient_accumulation_steps, the schedule's settings)")
    if world is not None:
        read.append(f"{world} process(es) at save ({', '.join(rng) if len(rng) <= 4 else f'{len(rng)} rng_state_N.pth'})")
    else:
        missing.append("the number of processes at save (rng_state.pth, or rng_state_0..N-1.pth, all there)")
    if batch is None:
        missing.append("the batch size at save (trainer_state.json train_batch_size)")
    if saved.global_step is None and state:
        missing.append("global_step (trainer_state.json)")
    saved.read, saved.missing = read, missing
    return saved


def _rng_files(folder: str) -> list[str]:
    """The Trainer's rng_state.pth (one process) or rng_state_<rank>.pth files in `folder` (`_save_rng_state`)."""
    import os
    import re

    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(n for n in names if re.fullmatch(r"rng_state(_\d+)?\.pth", n))


@dataclass
class Position:
    """The answer for one resume: None fields were not computable (`unknown` says why)."""

    saved: Saved
    new: Layout
    changed: bool = False  # samples per step differ
    unknown: str = ""
    lengthless: bool = False  # a dataset without __len__ (IterableDataset): no epochs
    dataset_length: tuple[int, int] | None = None  # exact when both ends are equal
    seen: tuple[int, int] | None = None  # samples the saved run had drawn (all epochs), lo..hi over the lengths
    skipped: tuple[int, int] | None = None  # samples the resumed Trainer skips
    difference: tuple[int, int] | None = None  # skipped - seen: > 0 never trained, < 0 trained twice
    epochs_skipped: tuple[int, int] | None = None
    batches_skipped: tuple[int, int] | None = None  # per process, of the new size, in the resumed epoch
    steps_per_epoch: tuple[tuple[int, int], tuple[int, int]] | None = None  # (saved lo, hi), (resumed lo, hi)
    schedule_rebuilt: bool = False
    ends_before_start: bool = False  # the rebuilt schedule ends at or before global_step: nothing more is trained
    total_steps: tuple[int | None, tuple[int, int] | None] = (None, None)  # saved max_steps, resumed lo..hi
    lr_original: float | None = None  # the original run's lr at step global_step + 2
    lr_resumed: tuple[float, float] | None = None  # the rebuilt schedule's there
    lr_note: str = ""
    fix: str = ""
    notes: list[str] = field(default_factory=list)


def new_layout(saved: Saved, batch_size: int | None = None, grad_accum: int | None = None,
               world_size: int | None = None) -> Layout:
    """The resumed run's layout: each setting not given is the saved one (which may itself be unknown)."""
    old = saved.layout
    return Layout(batch_size if batch_size is not None else old.batch_size,
                  grad_accum if grad_accum is not None else old.grad_accum,
                  world_size if world_size is not None else old.world_size)


def _batches(n: int, per_batch: int, drop_last: bool) -> int:
    return n // per_batch if drop_last else -(-n // per_batch)


def _steps_per_epoch(n: int, layout: Layout, drop_last: bool) -> int:
    """`set_initial_training_values`: max(ceil(len(dataloader) / grad_accum), 1); len(dataloader) per process is
    ceil(n / (batch x processes)) (accelerate's even_batches), or the floor with dataloader_drop_last."""
    assert layout.batch_size and layout.grad_accum and layout.world_size
    batches = _batches(n, layout.batch_size * layout.world_size, drop_last)
    return max(-(-batches // layout.grad_accum), 1)


def _epoch_at(step: int, batches: int, grad_accum: int) -> float:
    """trainer_state's `epoch` after optimizer step `step`: epoch + batches consumed / batches per epoch."""
    per_epoch = max(-(-batches // grad_accum), 1)
    done, within = divmod(step, per_epoch)
    return done + (within * grad_accum) / batches


def batches_per_epoch(saved: Saved) -> tuple[int, int] | None:
    """The saved run's batches per epoch per process (len(train_dataloader)), from trainer_state's epoch at
    global_step and log_history's (step, epoch) pairs: the lo..hi range that fits them all, None if none does."""
    g, step, epoch = saved.layout.grad_accum, saved.global_step, saved.epoch
    if not g or not step or epoch is None or epoch <= 0:
        return None
    # epoch = e + k*g/L with step = e*ceil(L/g) + k, so L lies in [step*g/epoch - g, step*g/epoch]
    centre = step * g / epoch
    pairs = [(step, epoch), *saved.history]
    fits = [n for n in range(max(1, math.floor(centre) - g - 1), math.ceil(centre) + 2)
            if all(math.isclose(_epoch_at(s, n, g), e, rel_tol=1e-9, abs_tol=1e-9) for s, e in pairs)]
    return (min(fits), max(fits)) if fits and max(fits) - min(fits) == len(fits) - 1 else None


def position(saved: Saved, new: Layout, dataset_length: int | None = None,
             ignore_data_skip: bool | None = None, args_max_steps: int | None = None,
             args_epochs: float | None = None) -> Position:
    """Where `trainer.train(resume_from_checkpoint=...)` with `new` starts, against where the saved run stood.

    `dataset_length`: the training set's length when known (else bounded from trainer_state's epoch).
    `ignore_data_skip`, `args_max_steps`, `args_epochs`: the resumed run's, when they differ from the saved ones.
    """
    pos = Position(saved, new)
    old = saved.layout
    if new == old:  # every setting kept (known or not): the Trainer resumes where the saved run stood
        return pos
    if not (old.known and new.known) or saved.global_step is None:
        need = [m for m in saved.missing if not m.startswith("training_args.bin") or old.grad_accum is None]
        pos.unknown = "; ".join(need) or "the layout at save"
        return pos
    s0, s1 = old.samples_per_step, new.samples_per_step
    pos.changed = s0 != s1
    if not pos.changed:
        return pos
    g_step = saved.global_step
    skip_data = not (saved.ignore_data_skip if ignore_data_skip is None else ignore_data_skip)
    max_steps = saved.args_max_steps if args_max_steps is None else args_max_steps
    epochs = saved.args_epochs if args_epochs is None else args_epochs
    epoch_driven = max_steps is not None and max_steps <= 0
    pos.lengthless = saved.state_epochs == _LENGTHLESS
    if pos.lengthless:
        lengths: range = range(0)
    elif dataset_length is not None:
        lengths = range(dataset_length, dataset_length + 1)
    else:
        per_epoch = batches_per_epoch(saved)
        if per_epoch is None:
            pos.unknown = ("the dataset length: trainer_state.json's epoch does not give the batches per epoch "
                           "(pass the dataset length)")
            return pos
        per_batch = old.batch_size * old.world_size  # type: ignore[operator]
        lo, hi = per_epoch
        lengths = (range(lo * per_batch, (hi + 1) * per_batch) if saved.drop_last
                   else range((lo - 1) * per_batch + 1, hi * per_batch + 1))
        if len(lengths) > _MAX_LENGTHS:
            pos.unknown = f"the dataset length (only known to lie in {lengths[0]}..{lengths[-1]}; pass it)"
            return pos
    if epoch_driven and (epochs is None or (pos.lengthless and not max_steps)):
        pos.unknown = "num_train_epochs at save (training_args.bin)"
        return pos

    b0, g0, w0 = old.batch_size or 1, old.grad_accum or 1, old.world_size or 1
    b1, g1, w1 = new.batch_size or 1, new.grad_accum or 1, new.world_size or 1
    rows: list[tuple[int, int, int, int, int, int, int, int]] = []  # n, u0, u1, seen, skipped, epochs, batches, total
    for n in lengths or [-1]:
        if n < 0:  # no __len__: one endless epoch of max_steps updates, no wrap
            u0 = u1 = saved.max_steps or g_step + 1
            cap = g_step * max(s0, s1)
        else:
            u0, u1 = _steps_per_epoch(n, old, saved.drop_last), _steps_per_epoch(n, new, saved.drop_last)
            cap = n
        e0, k0 = divmod(g_step, u0)
        e1, k1 = divmod(g_step, u1)
        seen = e0 * max(n, 0) + min(k0 * g0 * b0 * w0, cap)
        batches = k1 * g1 if skip_data else 0
        skipped = e1 * max(n, 0) + min(batches * b1 * w1, cap)
        total = math.ceil(epochs * u1) if epoch_driven and n >= 0 and epochs is not None else 0
        if total and total <= g_step:  # the rebuilt run ends before it starts: it trains nothing more
            pos.ends_before_start = True
            ends, within = divmod(total, u1)
            skipped = min(skipped, ends * n + min(within * s1, n))
        rows.append((n, u0, u1, seen, skipped, e1, batches, total))

    def span(i: int) -> tuple[int, int]:
        return min(r[i] for r in rows), max(r[i] for r in rows)

    if not pos.lengthless:
        pos.dataset_length = span(0)
    pos.steps_per_epoch = (span(1), span(2))
    pos.seen, pos.skipped = span(3), span(4)
    diffs = [r[4] - r[3] for r in rows]
    pos.difference = (min(diffs), max(diffs))
    pos.epochs_skipped, pos.batches_skipped = span(5), span(6)
    if epoch_driven and not pos.lengthless:
        totals = span(7)
        pos.total_steps = (saved.max_steps, totals)
        pos.schedule_rebuilt = totals != (saved.max_steps, saved.max_steps)
    if pos.schedule_rebuilt:
        _lr(pos, g_step)
    pos.fix = _fix(s0, new)
    if not skip_data:
        pos.notes.append("ignore_data_skip=True: the Trainer skips whole epochs only")
    return pos


def _warmup(warmup: float, total: int) -> int:
    """TrainingArguments.get_warmup_steps: int(warmup_steps) when >= 1, else ceil(total x warmup_steps)."""
    return int(warmup) if warmup >= 1 else math.ceil(total * warmup)


def lr_lambda(kind: str, step: int, total: int, warmup: int, kwargs: dict[str, Any],
              lr_init: float | None = None) -> float | None:
    """transformers.optimization's LambdaLR factor for `kind` at `step` (None for a kind not computed here)."""
    if kind == "constant":
        return 1.0
    if step < warmup and kind in ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant_with_warmup"):
        return float(step) / float(max(1, warmup))
    if kind == "constant_with_warmup":
        return 1.0
    if kind == "linear":
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    progress = float(step - warmup) / float(max(1, total - warmup))
    if kind == "cosine":
        cycles, floor = float(kwargs.get("num_cycles", 0.5)), float(kwargs.get("min_lr_rate", 0.0))
        factor = 0.5 * (1.0 + math.cos(math.pi * cycles * 2.0 * progress))
        return max(0.0, factor * (1 - floor) + floor)
    if kind == "cosine_with_restarts":
        if progress >= 1.0:
            return 0.0
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(kwargs.get("num_cycles", 1)) * progress) % 1.0))))
    if kind == "polynomial" and lr_init:
        end, power = float(kwargs.get("lr_end", 1e-7)), float(kwargs.get("power", 1.0))
        if step > total:
            return end / lr_init
        return ((lr_init - end) * (1 - (step - warmup) / (total - warmup)) ** power + end) / lr_init
    return None


def _lr(pos: Position, g_step: int) -> None:
    """The LR of step global_step + 2: the first resumed step runs at the lr optimizer.pt holds (the restored
    scheduler does not recompute it); its `step()` then sets lambda(global_step + 1) of the rebuilt schedule."""
    saved = pos.saved
    total0, totals = pos.total_steps
    kind, base = saved.scheduler_type, saved.base_lr
    if kind is None or base is None or saved.warmup is None or total0 is None or totals is None:
        pos.lr_note = "the LR was not computed (lr_scheduler_type, warmup_steps or base_lrs not recorded)"
        return
    step = g_step + 1
    old = lr_lambda(kind, step, total0, _warmup(saved.warmup, total0), saved.scheduler_kwargs, saved.learning_rate)
    new = [lr_lambda(kind, step, t, _warmup(saved.warmup, t), saved.scheduler_kwargs, saved.learning_rate)
           for t in range(totals[0], totals[1] + 1)]
    factors = [f for f in new if f is not None]
    if old is None or len(factors) != len(new):
        pos.lr_note = f"the LR of a {kind} schedule is not computed here"
        return
    pos.lr_original = base * old
    pos.lr_resumed = (base * min(factors), base * max(factors))


def _fix(samples: int, new: Layout) -> str:
    """The gradient accumulation (else the batch size) that restores the saved samples per step, if one does."""
    assert new.batch_size and new.grad_accum and new.world_size
    per_micro = new.batch_size * new.world_size
    if samples % per_micro == 0:
        return (f"gradient_accumulation_steps={samples // per_micro} (with per_device_train_batch_size="
                f"{new.batch_size} on {new.world_size} process(es): {samples} samples per step, as saved)")
    per_step = new.grad_accum * new.world_size
    if samples % per_step == 0:
        return (f"per_device_train_batch_size={samples // per_step} (with gradient_accumulation_steps="
                f"{new.grad_accum} on {new.world_size} process(es): {samples} samples per step, as saved)")
    return ""


@dataclass(frozen=True)
class ResumeWith:
    """The settings a resume will use (`inspect --batch-size/--grad-accum/--world-size/--dataset-length`); None:
    the saved one."""

    batch_size: int | None = None
    grad_accum: int | None = None
    world_size: int | None = None
    dataset_length: int | None = None

    def describe(self) -> str:
        given = [f"{name} {value}" for name, value in (("batch size", self.batch_size), ("grad accum", self.grad_accum),
                 ("world size", self.world_size), ("dataset length", self.dataset_length)) if value is not None]
        return ", ".join(given) or "the saved settings"


def resume_position(ckpt: Any, resume: ResumeWith) -> Position | None:
    """`position` for a Trainer checkpoint resumed with `resume`; None for another format."""
    saved = saved_layout(ckpt)
    if saved is None:
        return None
    new = new_layout(saved, resume.batch_size, resume.grad_accum, resume.world_size)
    return position(saved, new, resume.dataset_length)


def notes(ckpt: Any, resume: ResumeWith) -> list[str]:
    """inspect's notes line: what was read for the data position, and the answer when nothing changes."""
    saved = saved_layout(ckpt)
    if saved is None:
        return []
    head = f"data position (resume with {resume.describe()}): read " + ("; ".join(saved.read) or "nothing")
    pos = resume_position(ckpt, resume)
    if pos is not None and not pos.changed and not pos.unknown:
        head += (f"; samples per optimizer step unchanged ({saved.layout.describe()}): the Trainer resumes at the "
                 "sample the saved run stood at")
    return [head]
