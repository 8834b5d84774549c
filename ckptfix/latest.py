"""`ckptfix latest RUN_DIR`: the newest checkpoint of a run folder that is complete and whole.

A save interrupted part-way (a killed job, a full disk) leaves the newest folder torn; the loaders see that only
when they fail. `latest_checkpoint` orders the candidates newest first, as their frameworks do, and checks each
one's structure only (no tensor bytes unless `scan`): the files the framework's resume reads are there, non-empty
and whole (a safetensors file's header tiles it exactly; a torch.save zip's central directory parses; JSON
parses). A reader's one-line `UnreadableCheckpoint` is the reason a candidate is torn.

Candidates: Hugging Face Trainer `checkpoint-N/` (newest = highest N, as `transformers.trainer_utils.
get_last_checkpoint`), Lightning `*.ckpt` (`last.ckpt` first, then `step=N` in the name, then mtime), DCP /
torchtitan `step-N/`, Megatron `iter_N/`, DeepSpeed `global_stepN/` and accelerate's `checkpoint_N/`
(`automatic_checkpoint_naming`; newest = highest N, as `Accelerator.load_state()` picks it).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from ckptfix.errors import CkptfixError, UnreadableCheckpoint

HF_TRAINER = re.compile(r"^checkpoint-(\d+)$")  # transformers' _re_checkpoint
DCP_STEP = re.compile(r"^step-(\d+)$")
MEGATRON_ITER = re.compile(r"^iter_(\d+)$")
DEEPSPEED_STEP = re.compile(r"^global_step(\d+)$")
ACCELERATE_STEP = re.compile(r"^checkpoint_(\d+)$")  # ProjectConfiguration(automatic_checkpoint_naming=True)
LIGHTNING_STEP = re.compile(r"step=(\d+)")
LIGHTNING_EPOCH = re.compile(r"epoch=(\d+)")


@dataclass
class Candidate:
    """One checkpoint of the run: its path, kind, and why it is not whole (`reasons`, empty when it is)."""

    path: str
    kind: str  # hf-trainer, lightning, dcp, megatron, deepspeed, accelerate
    order: tuple[float, int]  # (step-like number, mtime_ns): larger is newer
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # whole, but worth saying (no RNG state)

    @property
    def whole(self) -> bool:
        return not self.reasons


@dataclass
class Latest:
    """The verdict: `path` is the newest whole checkpoint (None when none is); `checked` holds the candidates
    examined, newest first, ending with the chosen one."""

    run_dir: str
    path: str | None
    checked: list[Candidate]

    @property
    def skipped(self) -> list[Candidate]:
        return [c for c in self.checked if not c.whole]

    @property
    def chosen(self) -> Candidate | None:
        return next((c for c in self.checked if c.whole), None)


def latest_checkpoint(run_dir: str | os.PathLike[str], *, scan: bool = False) -> Latest:
    """The newest whole checkpoint in `run_dir` (see the module docstring). Raises `UnreadableCheckpoint` when
    `run_dir` is not a readable folder."""
    folder = os.fspath(run_dir)
    if not os.path.isdir(folder):
        raise UnreadableCheckpoint(f"{folder}: not a folder (name a run's output folder, which holds the checkpoints)")
    candidates = sorted(find_candidates(folder), key=lambda c: c.order, reverse=True)
    checked = []
    for cand in candidates:
        check_candidate(cand, scan=scan)
        checked.append(cand)
        if cand.whole:
            return Latest(folder, cand.path, checked)
    return Latest(folder, None, checked)


def find_candidates(folder: str) -> list[Candidate]:
    try:
        names = os.listdir(folder)
    except OSError as exc:
        raise UnreadableCheckpoint(f"{folder}: cannot list ({exc.strerror})") from None
    out = []
    for name in names:
        path = os.path.join(folder, name)
        if os.path.isdir(path):
            for kind, pattern in (("hf-trainer", HF_TRAINER), ("dcp", DCP_STEP), ("megatron", MEGATRON_ITER),
                                  ("deepspeed", DEEPSPEED_STEP), ("accelerate", ACCELERATE_STEP)):
                if m := pattern.match(name):
                    out.append(Candidate(path, kind, (int(m.group(1)), _mtime(path))))
        elif name.endswith(".ckpt") and os.path.isfile(path):
            out.append(Candidate(path, "lightning", (_lightning_number(name), _mtime(path))))
    return out


def _lightning_number(name: str) -> float:
    """last.ckpt (saved after the others of its step) first, then the step (or epoch) its name holds; a
    name with neither is ordered by mtime alone."""
    if name == "last.ckpt" or re.fullmatch(r"last-v\d+\.ckpt", name):
        return float("inf")
    m = LIGHTNING_STEP.search(name) or LIGHTNING_EPOCH.search(name)
    return int(m.group(1)) if m else -1


def _mtime(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0


def check_candidate(cand: Candidate, *, scan: bool = False) -> None:
    """Fill `cand.reasons` (why it is not whole) and `cand.notes`."""
    try:
        {"hf-trainer": _check_hf_trainer, "lightning": _check_lightning, "dcp": _check_dcp,
         "megatron": _check_megatron, "deepspeed": _check_deepspeed,
         "accelerate": _check_accelerate}[cand.kind](cand, scan)
    except CkptfixError as exc:
        cand.reasons.append(_one_line(str(exc)))
    except OSError as exc:  # a folder that cannot be listed, a file gone while being read
        cand.reasons.append(_one_line(f"cannot read {exc.filename or cand.path} ({exc.strerror})"))


# -- one file --------------------------------------------------------------------------------------------------


def file_reason(path: str, what: str, *, scan: bool = False) -> str | None:
    """Why the file `path` (`what`, e.g. "optimizer.pt") is not whole, or None: present, non-empty, and its
    structure parses (safetensors header tiles the file; torch.save zip central directory; JSON)."""
    if not os.path.isfile(path):
        return f"no {what}"
    size = os.path.getsize(path)
    if size == 0:
        return f"{what} is empty (0 bytes)"
    try:
        if path.endswith(".json"):
            _check_json(path)
        elif path.endswith(".safetensors"):
            from ckptfix.formats.safetensors_file import read_header

            read_header(path)  # checks the tensors tile the data section: 8 + header + data == file size
        elif path.endswith((".pt", ".pth", ".bin", ".ckpt")):
            _check_torch_file(path, scan)
    except CkptfixError as exc:
        return f"{what}: {_one_line(str(exc))}"
    except OSError as exc:  # unreadable (permissions), vanished while being read
        return f"{what}: cannot read ({exc.strerror})"
    return None


MAX_JSON = 64 << 20  # trainer_state.json, an index: far smaller; refuse to read more


def _read_json(path: str) -> object:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_JSON + 1)
        if len(data) > MAX_JSON:
            raise UnreadableCheckpoint(f"{path}: larger than {MAX_JSON:,} bytes; refusing to read it")
        return json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise UnreadableCheckpoint(f"{path}: not valid JSON ({type(exc).__name__}: {exc}); truncated?") from None
    except OSError as exc:
        raise UnreadableCheckpoint(f"{path}: cannot read ({exc.strerror})") from None


def _check_json(path: str) -> None:
    _read_json(path)


def _check_torch_file(path: str, scan: bool) -> None:
    from ckptfix.formats import torch_file

    torch_file.check_whole(path, scan=scan)


# -- the kinds ---------------------------------------------------------------------------------------------------


def _check_hf_trainer(cand: Candidate, scan: bool) -> None:
    """What `Trainer.train(resume_from_checkpoint=...)` reads. The Trainer saves the model, then optimizer.pt,
    scheduler.pt, scaler.pt, rng_state*.pth, and trainer_state.json last (`Trainer._save_checkpoint`)."""
    d = cand.path
    names = set(os.listdir(d))
    add = cand.reasons.append
    if "trainer_state.json" not in names:
        add("no trainer_state.json (the Trainer writes it last: the save did not finish)")
    elif reason := file_reason(os.path.join(d, "trainer_state.json"), "trainer_state.json"):
        add(reason)
    _check_hf_weights(cand, names, scan)
    deepspeed = any(DEEPSPEED_STEP.match(n) for n in names)  # DeepSpeed's own folder holds optimizer and scheduler
    fsdp = any(n.startswith("optimizer_") and os.path.isdir(os.path.join(d, n)) for n in names)
    if not deepspeed:
        if not fsdp:
            optimizer = "optimizer.bin" if "optimizer.bin" in names and "optimizer.pt" not in names else "optimizer.pt"
            if reason := file_reason(os.path.join(d, optimizer), optimizer, scan=scan):
                add(reason)
        if reason := file_reason(os.path.join(d, "scheduler.pt"), "scheduler.pt", scan=scan):
            add(reason)
    else:
        for n in sorted(names):
            if DEEPSPEED_STEP.match(n):
                _check_deepspeed_folder(cand, os.path.join(d, n), scan)
    if "scaler.pt" in names and (reason := file_reason(os.path.join(d, "scaler.pt"), "scaler.pt", scan=scan)):
        add(reason)
    rng = sorted(n for n in names if re.fullmatch(r"rng_state(_\d+)?\.pth", n))
    if not rng:
        cand.notes.append("no rng_state*.pth: the Trainer resumes without it (with a warning), but the data order "
                          "and dropout are not reproduced")
    for n in rng:
        if reason := file_reason(os.path.join(d, n), n, scan=scan):
            add(reason)


def _check_hf_weights(cand: Candidate, names: set[str], scan: bool) -> None:
    d = cand.path
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if index in names:
            _check_index(cand, os.path.join(d, index), index, scan)
            return
    for single in ("model.safetensors", "adapter_model.safetensors", "pytorch_model.bin", "adapter_model.bin"):
        if single in names:
            if reason := file_reason(os.path.join(d, single), single, scan=scan):
                cand.reasons.append(reason)
            return
    if not any(DEEPSPEED_STEP.match(n) or n.startswith("pytorch_model_fsdp") for n in names):
        cand.reasons.append("no model weights (model.safetensors, a sharded index, pytorch_model.bin or adapter_model.*)")


def _check_index(cand: Candidate, index_path: str, index: str, scan: bool) -> None:
    if reason := file_reason(index_path, index):
        cand.reasons.append(reason)
        return
    data = _read_json(index_path)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        cand.reasons.append(f"{index}: no weight_map of file names")
        return
    for shard in sorted(set(weight_map.values())):
        if os.path.isabs(shard) or ".." in shard.replace("\\", "/").split("/"):
            cand.reasons.append(f"{index}: shard {shard!r:.80} lies outside the folder")
            continue
        if reason := file_reason(os.path.join(cand.path, shard), shard, scan=scan):
            cand.reasons.append(reason)


def _check_lightning(cand: Candidate, scan: bool) -> None:
    """Whole, and holding the keys `fit(ckpt_path=...)` reads (`common.lightning_resume_gaps`, read with the allowlist
    in opaque mode: nothing imported): a key it raises on or the loops it restarts without is a reason; a weights-only
    save too (fit raises KeyError on it); missing callbacks a note."""
    if reason := file_reason(cand.path, os.path.basename(cand.path), scan=scan):
        cand.reasons.append(reason)
        return
    from ckptfix.formats import common, torch_file

    tree, _, _ = torch_file.load(cand.path, opaque=True)
    if not isinstance(tree, dict) or not any(k in tree for k in (*common.LIGHTNING_KEYS, "loops")):
        return  # not Lightning's: whole is all that can be said
    gaps = common.lightning_resume_gaps(tree)
    if any(v == "weights-only" for v in gaps.values()):
        cand.reasons.append("saved with save_weights_only=True: fit(ckpt_path=...) raises KeyError on it")
    for key, what in gaps.items():
        if what == "raises" or key == "loops":
            cand.reasons.append(f"no '{key}' key (fit(ckpt_path=...) " +
                                ("raises KeyError)" if what == "raises" else "restarts epoch and global_step at 0)"))
        elif what == "fresh":
            cand.notes.append(f"no '{key}' key: fit(ckpt_path=...) resumes with the callbacks' state fresh")


def _check_dcp(cand: Candidate, scan: bool) -> None:
    """DCP writes the data files first and `.metadata` last (its `finish`): no `.metadata`, no checkpoint. Every
    data file the metadata names must be there, non-empty, and reach the end of its last piece."""
    d = cand.path
    if not os.path.isfile(os.path.join(d, ".metadata")):
        cand.reasons.append("no .metadata (DCP writes it last: the save did not finish)")
        return
    if os.path.getsize(os.path.join(d, ".metadata")) == 0:
        cand.reasons.append(".metadata is empty (0 bytes)")
        return
    from ckptfix.formats import dcp_folder

    items, _version = dcp_folder.read_metadata(d)
    cand.reasons += [why for why, _ in dcp_folder.data_file_problems(d, items)]  # what dcp.load needs: inspect's rule


def _check_megatron(cand: Candidate, scan: bool) -> None:
    d = cand.path
    names = set(os.listdir(d))
    if ".metadata" in names or "common.pt" in names or "metadata.json" in names:  # torch_dist
        _check_dcp(cand, scan)
        if reason := file_reason(os.path.join(d, "common.pt"), "common.pt", scan=scan):
            cand.reasons.append(reason)
        return
    ranks = sorted(n for n in names if n.startswith("mp_rank_") and os.path.isdir(os.path.join(d, n)))
    if not ranks:
        cand.reasons.append("neither a torch_dist .metadata nor mp_rank_*/ folders")
    for rank in ranks:
        files = sorted(f for f in os.listdir(os.path.join(d, rank)) if f.endswith((".pt", ".pth")))
        if not files:
            cand.reasons.append(f"{rank}/ holds no model_optim_rng.pt")
        for f in files:
            if reason := file_reason(os.path.join(d, rank, f), f"{rank}/{f}", scan=scan):
                cand.reasons.append(reason)


def _check_deepspeed(cand: Candidate, scan: bool) -> None:
    _check_deepspeed_folder(cand, cand.path, scan)


def _check_deepspeed_folder(cand: Candidate, d: str, scan: bool) -> None:
    names = sorted(os.listdir(d))
    prefix = "" if d == cand.path else os.path.basename(d) + "/"
    models = [n for n in names if n.endswith("model_states.pt")]
    optims = [n for n in names if n.endswith("optim_states.pt")]
    if not models:
        cand.reasons.append(f"no {prefix}*model_states.pt")
    if not optims and not any(n.startswith("zero_pp_rank_") for n in names):
        cand.reasons.append(f"no {prefix}*optim_states.pt")
    for n in models + optims:
        if reason := file_reason(os.path.join(d, n), prefix + n, scan=scan):
            cand.reasons.append(reason)
    if models and not cand.reasons:  # one ZeRO partition per data-parallel rank of the save: inspect's rule (CKF319)
        from ckptfix.formats import deepspeed_folder, torch_file

        tree, _, _ = torch_file.load(os.path.join(d, models[0]), opaque=True)
        if isinstance(tree, dict):
            files = deepspeed_folder.resume_files(d, d, tree, [os.path.join(d, n) for n in models],
                                                  [os.path.join(d, n) for n in optims])
            cand.reasons += [f"no {prefix}{name} ({why})" for name, why in sorted(files["missing"].items())]


def _check_accelerate(cand: Candidate, scan: bool) -> None:
    """What `Accelerator.load_state` reads (`accelerate_folder.resume_files`): a missing weights/optimizer/scheduler/
    custom_checkpoint file or a torn one stops it; a missing or torn random_states file it skips (a note)."""
    from ckptfix.formats import accelerate_folder

    ckpt = accelerate_folder.read(cand.path)  # a torn weights/optimizer/scheduler/scaler file: its refusal
    files = ckpt.extras["accelerate_files"]
    for name in sorted(files["missing"]):
        (cand.notes if name.startswith("random_states") else cand.reasons).append(f"no {name}")
    for name, why in sorted(files["torn"].items()):
        (cand.notes if name.startswith("random_states") else cand.reasons).append(f"{name}: {_one_line(why)}")
    if not files["rng"]:
        cand.notes.append("no random_states_0.pkl: load_state resumes without restoring the RNGs")
    for part in ("model", "optimizer", "scheduler", "scaler"):
        file = ckpt.files.get(part)
        if file and (reason := file_reason(file, os.path.basename(file), scan=scan)):
            cand.reasons.append(reason)


def tracker_note(run_dir: str, chosen: Candidate | None) -> str | None:
    """Megatron's `latest_checkpointed_iteration.txt` / DeepSpeed's `latest` naming another checkpoint than the
    chosen one (what those frameworks would load when told only the run folder)."""
    for file, kind, fmt in (("latest_checkpointed_iteration.txt", "megatron", "iter_{:07d}"),
                            ("latest", "deepspeed", "{}")):
        path = os.path.join(run_dir, file)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                named = f.read(256).strip()
        except (OSError, UnicodeDecodeError):
            continue
        if kind == "megatron" and named.isdigit():
            named = fmt.format(int(named))
        if chosen is None or os.path.basename(chosen.path) != named:
            return f"{file} names {named!r:.80}, not the newest whole checkpoint"
    return None


def _one_line(text: str) -> str:
    from ckptfix.untrusted import escape

    return escape(" ".join(text.split()))


def run_folder_message(folder: str) -> str | None:
    """For a reader handed a run's output folder instead of one checkpoint: one line naming the newest whole
    checkpoint in it and why each newer one is not whole; None when `folder` holds no candidate."""
    if not os.path.isdir(folder):
        return None
    result = latest_checkpoint(folder)
    if not result.checked:
        return None
    skipped = "; ".join(f"{os.path.basename(c.path)} is not whole: {'; '.join(c.reasons)}" for c in result.skipped)
    if result.path is None:
        return _one_line(f"{folder}: a run folder, not one checkpoint, and none of its {len(result.checked)} "
                         f"checkpoints is whole ({skipped})")
    newest = f"the newest whole checkpoint in it is {result.path}"
    return _one_line(f"{folder}: a run folder, not one checkpoint: {newest}" + (f" ({skipped})" if skipped else "")
                     + " (`ckptfix latest` prints it for scripts)")
