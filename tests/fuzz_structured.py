"""Structure-aware fuzzing of every input ckptfix reads, in-process, with per-input time and memory checks.

Seeds are real files from the test factories: a `torch.save` checkpoint after real AdamW steps (zip and
legacy), a safetensors file, an HF Trainer folder, a `dcp.save` folder, a DeepSpeed ZeRO-2 folder written
by the real engine (when deepspeed runs here), a sentencepiece model, a tokenizer.json and an HF
tokenizer folder. Each format has its own mutators that know its structure:

  pickle    opcode stream (parsed with pickletools): ints set to extremes, ops dropped/duplicated,
            deep MARK/TUPLE/LIST nests, memo-DAG runs (DUP+TUPLE2), strings with control characters
  tree      the unpickled tree: a node replaced by a wrong type, a huge/negative/NaN number, a deep or
            shared (DAG) structure, a tuple key; re-saved with torch.save
  zip       records of the torch zip: sizes, offsets, compression method, names, zip64 extra fields,
            truncation, duplicated members
  safetensors  the header JSON: dtypes, shapes, data_offsets, metadata; then the header length
  dcp       the `.metadata` Metadata object (sizes, chunks, storage offsets/lengths/paths, planner paths)
  deepspeed the model/optim-states trees (partition counts, shapes, fragment addresses)
  hf        folder-level: files removed, JSON config/index values changed, links, non-regular files
  tokenizer sentencepiece protobuf fields, tokenizer.json trees, vocab.txt lines, tokenizer folders

`run(fmt, n, seed)` runs n inputs through `ckptfix.cli.main` (inspect with random flags; repair and diff
for some) and returns (count, failures). A failure is an exit code outside 0/1/2, a traceback or an
internal error line, a run over `TIME_LIMIT` s of CPU time or one that never ends (`HANG_LIMIT` s of wall
clock), a peak over `MEM_LIMIT` bytes, a changed input or a stray file.

Time is the process's CPU time (all threads) per run: the long run shares 2 cores with other work at
nice 15, where a run of 0.1 s CPU waited 20 s for a core. A run over `TIME_LIMIT` s of wall clock but not
of CPU is kept apart (`slow_wall` in the log, the input under `slow/`) to be timed again on a quiet machine.

Memory is measured for every input as the whole process's peak resident size (VmHWM) above its resident
size at the start of the run: before each run the allocator hands its free pages back (`malloc_trim(0)`)
and the peak is reset (`/proc/self/clear_refs`), so a run cannot hide an allocation in pages an earlier
input left resident. This sees everything (Python objects, numpy, maps that are read), at no cost per
allocation. tracemalloc, which charges every allocation of the process (it roughly halved the fuzz rate),
runs only on every `TRACE_EVERY`-th input, and on all of them where /proc lacks VmHWM: a cross-check of
the Python heap that does not depend on the allocator giving pages back.

    nice -n 15 python tests/fuzz_structured.py FORMAT[,FORMAT...]|all N [SEED] [--until HH:MM] [--only kinds,paths,many]
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import os
import pickle
import pickletools
import random
import re
import shutil
import signal
import struct
import sys
import tempfile
import time
import tracemalloc
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

TIME_LIMIT = 5.0
HANG_LIMIT = 60.0  # wall-clock seconds: a run blocked on a FIFO or a lock uses no CPU
MEM_LIMIT = 300 << 20
TRACE_EVERY = 16  # inputs between two measured with tracemalloc too (see the module docstring)
FORMATS = ("pickle", "tree", "zip", "safetensors", "dcp", "deepspeed", "hf", "sentencepiece",
           "tokenizer_json", "tokenizer_folder")


# --- seeds ----------------------------------------------------------------------------------------

def make_seeds(root: Path, deepspeed: bool = True) -> dict[str, Path]:
    """Real files from the test factories (a few seconds; DeepSpeed in a subprocess when available)."""
    import torch
    from ckpt_factory import new_run, save_checkpoint, train
    from safetensors.torch import save_file
    from tokenizer_factory import make_hf_tokenizer_folder, train_sentencepiece, train_tokenizer_json

    root.mkdir(parents=True, exist_ok=True)
    run = train(new_run(vocab=48, dim=8, layers=1), 3)
    seeds = {"pth": save_checkpoint(run, root / "ckpt.pth")}
    torch.save({"model": run.model.state_dict(), "step": 3}, root / "legacy.pth", _use_new_zipfile_serialization=False)
    seeds["legacy"] = root / "legacy.pth"
    save_file({k: v.contiguous() for k, v in run.model.state_dict().items()}, root / "model.safetensors")
    seeds["safetensors"] = root / "model.safetensors"
    hf = root / "checkpoint-3"
    hf.mkdir()
    save_file({k: v.contiguous() for k, v in run.model.state_dict().items()}, hf / "model.safetensors")
    torch.save(run.optimizer.state_dict(), hf / "optimizer.pt")
    torch.save(run.scheduler.state_dict(), hf / "scheduler.pt")
    torch.save(run.scaler.state_dict(), hf / "scaler.pt")
    (hf / "trainer_state.json").write_text(json.dumps({"global_step": 3, "log_history": [{"loss": 1.0, "step": 3}]}))
    (hf / "config.json").write_text(json.dumps({"vocab_size": 48, "model_type": "tiny", "hidden_size": 8}))
    seeds["hf"] = hf
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(run.model, run.optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd, "sched": run.scheduler.state_dict(), "step": 3},
                 checkpoint_id=str(root / "dcp"))
    seeds["dcp"] = root / "dcp"
    seeds["sentencepiece"] = train_sentencepiece(root / "sp", 56)
    seeds["tokenizer_json"] = train_tokenizer_json(root / "tj", 60)
    seeds["tokenizer_folder"] = make_hf_tokenizer_folder(root, 60, added=["<x>"], special=["<s1>"], name="tokfolder")
    (root / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + [f"w{i}" for i in range(52)]))
    seeds["vocab_txt"] = root / "vocab.txt"
    if deepspeed:
        ds = _deepspeed_seed(root / "ds")
        if ds is not None:
            seeds["deepspeed"] = ds
    return seeds


def _deepspeed_seed(out: Path) -> Path | None:
    """A ZeRO-2 folder written by the real DeepSpeed engine (the script test_formats_deepspeed runs)."""
    import subprocess

    try:
        import deepspeed  # noqa: F401
        import test_formats_deepspeed as tfd
    except Exception:
        return None
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(tfd._free_port()),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "CUDA_VISIBLE_DEVICES": ""}
    script = tfd._SCRIPT.format(configs={"s2": (2, False)})
    proc = subprocess.run([sys.executable, "-c", script, str(out)], env=env, capture_output=True, text=True, timeout=300)
    return out / "s2" if proc.returncode == 0 else None


# --- generic value mutation -----------------------------------------------------------------------

def _deep(depth: int, kind: str) -> Any:
    node: Any = 1
    for _ in range(depth):
        node = [node] if kind == "list" else (node,) if kind == "tuple" else {"k": node}
    return node


def _dag(levels: int) -> Any:
    node: Any = [1]
    for _ in range(levels):
        node = [node, node]
    return node


def hostile_value(rng: random.Random) -> Any:
    """A value of the wrong type, sign, range or size, or a deep / shared structure."""
    import torch

    choices: list[Callable[[], Any]] = [
        lambda: None, lambda: True, lambda: -1, lambda: 0, lambda: 2 ** 63, lambda: -(2 ** 63) - 1,
        lambda: 10 ** rng.randint(20, 300), lambda: float("nan"), lambda: float("inf"), lambda: -float("inf"),
        lambda: 1e308, lambda: "x", lambda: "\x1b[2J\x1b]0;t\x07" + "\n" * 3, lambda: "a" * rng.randint(1, 100_000),
        lambda: [], lambda: {}, lambda: [1, 2, 3], lambda: {"a": [1]}, lambda: (1, 2), lambda: {(1, 2): 3},
        lambda: {1: 2}, lambda: b"\x00" * 10, lambda: _deep(rng.choice([50, 500, 5000]), rng.choice(["list", "tuple", "dict"])),
        lambda: _dag(rng.randint(10, 40)), lambda: list(range(rng.randint(0, 30_000))),
        lambda: torch.zeros(rng.choice([0, 1, 3])), lambda: torch.zeros(2, 2).as_strided((10 ** 6, 10 ** 3), (0, 0)),
        lambda: torch.zeros(1, dtype=rng.choice([torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.uint8])),
        lambda: 3.5, lambda: [float("nan")] * 3, lambda: set(range(3)),
    ]
    return rng.choice(choices)()


def mutate_tree(tree: Any, rng: random.Random, rounds: int = 1) -> Any:
    """Replace random nodes (values, keys) of a plain tree with hostile values; returns a new tree."""
    tree = copy.deepcopy(tree) if _small(tree) else tree
    for _ in range(rounds):
        parents = []
        stack: list[Any] = [tree]
        seen: set[int] = set()
        while stack and len(parents) < 5000:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if isinstance(node, dict):
                parents.append(node)
                stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
            elif isinstance(node, list):
                parents.append(node)
                stack.extend(v for v in node if isinstance(v, (dict, list)))
        if not parents:
            return hostile_value(rng)
        node = rng.choice(parents)
        if isinstance(node, dict) and node:
            key = rng.choice(list(node))
            if rng.random() < 0.15:
                node[hostile_key(rng)] = node.pop(key)
            elif rng.random() < 0.1:
                del node[key]
            else:
                node[key] = hostile_value(rng)
        elif isinstance(node, list) and node:
            i = rng.randrange(len(node))
            if rng.random() < 0.1:
                del node[i]
            else:
                node[i] = hostile_value(rng)
    return tree


def hostile_key(rng: random.Random) -> Any:
    return rng.choice([1, -1, (0, 1), None, True, 2.5, "\x1b[31m", "", "a" * 5000, "../x", frozenset({1})])


def _small(tree: Any) -> bool:
    return True


# --- format mutators: each returns a list of argv lists to run, given a scratch folder ---------------

class Ctx:
    def __init__(self, seeds: dict[str, Path], work: Path, rng: random.Random):
        self.seeds, self.work, self.rng = seeds, work, rng
        self.cache: dict[str, Any] = {}

    def flags(self) -> list[str]:
        r = self.rng
        return [f for f, p in (("--json", 0.4), ("--scan", 0.25), ("--verify", 0.2), ("--trust-pickle", 0.2))
                if r.random() < p]

    def commands(self, path: Path) -> list[list[str]]:
        """inspect with random flags; sometimes repair to a tokenizer or diff against the seed."""
        r = self.rng
        cmds = [["inspect", str(path), *self.flags()]]
        if r.random() < 0.15:
            cmds.append(["repair", str(path), "--tokenizer", str(self.seeds["sentencepiece"]), "-o",
                         str(self.work / ("out" + (path.suffix if path.is_file() else ""))), "--init", "zeros"])
        if r.random() < 0.1:
            cmds.append(["diff", str(self.seeds["pth"]), str(path)])
        return cmds


def _torch_bytes(obj: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _zip_members(data: bytes) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return [(i.filename, zf.read(i)) for i in zf.infolist()]


def _with_pkl(data: bytes | list[tuple[str, bytes]], pkl: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        for name, body in _zip_members(data) if isinstance(data, bytes) else data:
            zf.writestr(name, pkl if name.endswith("/data.pkl") else body)
    return out.getvalue()


def parse_pickle_ops(pkl: bytes) -> tuple[list, list[bytes]] | None:
    """The opcodes of a pickle and the bytes of each (None when it does not parse)."""
    try:
        ops = [(op, arg, pos) for op, arg, pos in pickletools.genops(pkl)]
    except Exception:
        return None
    bounds = [pos for _, _, pos in ops] + [len(pkl)]
    return ops, [pkl[bounds[i]:bounds[i + 1]] for i in range(len(ops))]


def mutate_pickle_ops(pkl: bytes, rng: random.Random, parsed: tuple[list, list[bytes]] | None = None) -> bytes:
    """Opcode-level: parse the stream, then edit ops (never just bytes: each edit is a whole op).
    `parsed` is `parse_pickle_ops(pkl)` when the caller keeps it (a seed is parsed once, not per input)."""
    parsed = parsed or parse_pickle_ops(pkl)
    if parsed is None:
        return pkl
    ops, spans = parsed[0], list(parsed[1])
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(max(1, len(spans) - 1))
        op = ops[min(i, len(ops) - 1)][0]
        choice = rng.random()
        if choice < 0.25 and op.name in ("BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT"):
            val = rng.choice([0, -1, 2 ** 31 - 1, -2 ** 31, 2 ** 63, 10 ** 40, 255, 65535])
            spans[i] = _int_op(val) if op.name != "BINFLOAT" else b"G" + struct.pack(">d", rng.choice(
                [float("nan"), float("inf"), -0.0, 1e308]))
        elif choice < 0.4:
            del spans[i]
        elif choice < 0.5:
            spans.insert(i, spans[rng.randrange(len(spans))])
        elif choice < 0.6:
            depth = rng.choice([50, 1000, 100_000])
            spans.insert(i, b"(" * depth + b"K\x01" + rng.choice([b"t", b"l"]) * depth)
        elif choice < 0.7:
            levels = rng.randint(20, 60)
            spans.insert(i, b"K\x01" + b"2\x86" * levels)  # DUP + TUPLE2: a memo-free tuple DAG
        elif choice < 0.8 and op.name in ("BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"):
            text = rng.choice(["\x1b[2J", "a" * 300, "../../etc/passwd", "", "\udcff".encode("utf-8", "surrogatepass").decode("latin-1")])
            raw = text.encode("utf-8", "surrogatepass")
            spans[i] = b"X" + struct.pack("<I", len(raw)) + raw
        elif choice < 0.9 and op.name in ("BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT"):
            spans[i] = op.code.encode("latin-1") + (bytes([rng.randrange(256)]) if op.name.startswith("BIN")
                                                    else struct.pack("<I", rng.choice([0, 2 ** 31, 2 ** 32 - 1])))
        else:
            k = rng.randrange(len(spans))
            spans[i], spans[k] = spans[k], spans[i]
    return b"".join(spans)


def _int_op(val: int) -> bytes:
    if -2 ** 31 <= val < 2 ** 31:
        return b"J" + struct.pack("<i", val)
    raw = val.to_bytes((val.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def gen_pickle(ctx: Ctx) -> list[list[str]]:
    if "members" not in ctx.cache:  # the seed's zip members and its data.pkl's opcodes, parsed once
        members = _zip_members(ctx.seeds["pth"].read_bytes())
        pkl = next(body for name, body in members if name.endswith("/data.pkl"))
        ctx.cache.update(members=members, pkl=pkl, parsed=parse_pickle_ops(pkl))
    out = ctx.work / "in.pth"
    mutated = mutate_pickle_ops(ctx.cache["pkl"], ctx.rng, ctx.cache["parsed"])
    out.write_bytes(_with_pkl(ctx.cache["members"], mutated) if ctx.rng.random() < 0.7 else mutated)
    return ctx.commands(out)


def gen_tree(ctx: Ctx) -> list[list[str]]:
    import torch

    if "tree" not in ctx.cache:
        ctx.cache["tree"] = torch.load(ctx.seeds["pth"], weights_only=True)
    tree = mutate_tree(_copy_tree(ctx.cache["tree"]), ctx.rng, ctx.rng.randint(1, 3))
    out = ctx.work / "in.pth"
    legacy = ctx.rng.random() < 0.2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save(tree, out, _use_new_zipfile_serialization=not legacy)
    return ctx.commands(out)


def _copy_tree(tree: Any) -> Any:
    """A structural copy (containers copied, tensors shared: mutation replaces, never edits them)."""
    if isinstance(tree, dict):
        return type(tree)((k, _copy_tree(v)) for k, v in tree.items())
    if isinstance(tree, list):
        return [_copy_tree(v) for v in tree]
    return tree


_ZIP_HEADS = re.compile(b"PK(?=\x03\x04|\x01\x02|\x05\x06|\x06\x06|\x06\x07)")


def gen_zip(ctx: Ctx) -> list[list[str]]:
    data = bytearray(ctx.seeds["pth"].read_bytes())
    rng = ctx.rng
    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        heads = [m.start() for m in _ZIP_HEADS.finditer(data)]
        if not heads:
            break
        at = rng.choice(heads)
        sig = bytes(data[at:at + 4])
        if kind < 0.5:  # a header field: sizes, offsets, method, name length, extra length
            fields = {b"PK\x03\x04": [8, 18, 22, 26, 28], b"PK\x01\x02": [10, 20, 24, 28, 30, 42],
                      b"PK\x05\x06": [8, 10, 12, 16], b"PK\x06\x06": [24, 32, 40, 48], b"PK\x06\x07": [8]}.get(sig, [8])
            off = at + rng.choice(fields)
            width = 8 if sig in (b"PK\x06\x06", b"PK\x06\x07") else (2 if off - at in (8, 10, 26, 28, 30) else 4)
            val = rng.choice([0, 1, 0xFFFFFFFF, 2 ** (8 * width) - 1, rng.randrange(2 ** (8 * min(width, 4))), 8])
            data[off:off + width] = (val % 2 ** (8 * width)).to_bytes(width, "little")
        elif kind < 0.6:  # a zip64 extra field claiming 4 EiB
            if sig == b"PK\x01\x02":
                data[at + 20:at + 28] = b"\xff" * 8
                extra = struct.pack("<HHQQ", 1, 16, 1 << 62, 1 << 62)
                nlen = int.from_bytes(data[at + 28:at + 30], "little")
                elen = int.from_bytes(data[at + 30:at + 32], "little")
                ins = at + 46 + nlen
                data[ins:ins + elen] = extra
                data[at + 30:at + 32] = len(extra).to_bytes(2, "little")
        elif kind < 0.75:
            cut = rng.randrange(len(data))
            del data[cut:]
        elif kind < 0.9:  # a name byte: traversal, control characters
            if sig in (b"PK\x03\x04", b"PK\x01\x02"):
                base = at + (30 if sig == b"PK\x03\x04" else 46)
                data[base:base + 3] = rng.choice([b"../", b"\x1b[3", b"/et", b"\x00\x00\x00"])
        else:
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
    out = ctx.work / "in.pth"
    out.write_bytes(bytes(data))
    return ctx.commands(out)


def gen_safetensors(ctx: Ctx) -> list[list[str]]:
    raw = ctx.seeds["safetensors"].read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    body = raw[8 + n:]
    rng = ctx.rng
    for _ in range(rng.randint(1, 3)):
        name = rng.choice(list(header))
        entry = header[name]
        r = rng.random()
        if name == "__metadata__" or not isinstance(entry, dict):
            header[name] = hostile_value_json(rng)
        elif r < 0.3:
            entry["shape"] = rng.choice([[-1], [2 ** 62, 2 ** 62], [1] * 30_000, [10 ** 30], "x", None, [[1]],
                                         [0], [len(body)], [2, 2 ** 40]])
        elif r < 0.5:
            entry["dtype"] = rng.choice(["F8_E4M3", "I128", "", 7, None, "\x1b[2J", "F64", "BOOL", "U64", "F4"])
        elif r < 0.8:
            entry["data_offsets"] = rng.choice([[0, 2 ** 63], [-1, 4], [5, 3], [0], "x", [0, len(body) + 1],
                                                [0.5, 1], [10 ** 30, 10 ** 30 + 4]])
        else:
            header[rng.choice(["\x1b[31m", "", "a" * 1000, "x.weight"])] = copy.deepcopy(entry)
    text = json.dumps(header).encode()
    if rng.random() < 0.1:
        text = text.replace(b"[", b"[" * 1000, 1)
    length = len(text) if rng.random() < 0.85 else rng.choice([0, 2 ** 63, len(text) + 100, 7])
    out = ctx.work / "in.safetensors"
    out.write_bytes(length.to_bytes(8, "little", signed=False) + text + body)
    return ctx.commands(out)


def hostile_value_json(rng: random.Random) -> Any:
    return rng.choice([None, True, -1, 2 ** 70, 10 ** 300, 1e308, "x", "\x1b[2J", [], {}, [1, 2], {"a": {"b": []}},
                       "a" * 10_000, _deep_json(rng.choice([10, 150, 5000]))])


def _deep_json(depth: int) -> Any:
    node: Any = 1
    for _ in range(depth):
        node = [node]
    return node


def _copy_folder(src: Path, dst: Path) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, symlinks=True)


def gen_dcp(ctx: Ctx) -> list[list[str]]:
    src = ctx.seeds["dcp"]
    dst = ctx.work / "in_dcp"
    _copy_folder(src, dst)
    if "md" not in ctx.cache:
        ctx.cache["md"] = (src / ".metadata").read_bytes()
    md = pickle.loads(ctx.cache["md"])  # our own file, written by dcp.save above: trusted
    rng = ctx.rng
    for _ in range(rng.randint(1, 3)):
        r = rng.random()
        fqn = rng.choice(list(md.state_dict_metadata))
        entry = md.state_dict_metadata[fqn]
        if r < 0.25 and hasattr(entry, "size"):
            object.__setattr__(entry, "size", rng.choice([[10 ** 300], [-1], [1] * 30_000, "x", None, [2 ** 62] * 2,
                                                         [1.5], (3,)]))
        elif r < 0.35 and hasattr(entry, "chunks"):
            object.__setattr__(entry, "chunks", rng.choice([None, "x", [], [entry.chunks[0]] * 100, _dag(30)]))
        elif r < 0.6 and md.storage_data:
            key = rng.choice(list(md.storage_data))
            info = md.storage_data[key]
            field = rng.choice(["offset", "length", "relative_path"])
            value = rng.choice([-1, 2 ** 63, float("inf"), "x", None, "../../etc/passwd", "/dev/zero", 10 ** 300,
                                "__0_0.distcp", 0])
            with contextlib.suppress(Exception):
                object.__setattr__(info, field, value)
        elif r < 0.75 and md.planner_data:
            k = rng.choice(list(md.planner_data))
            md.planner_data[k] = rng.choice([("model",) * 100_000, None, "x", (), ((1,),), (None,), _dag(25)])
        elif r < 0.85:
            md.state_dict_metadata[rng.choice([1, None, (0,), "\x1b[31m", "a" * 10000])] = entry
        else:
            md.state_dict_metadata[fqn] = hostile_value(rng) if rng.random() < 0.5 else md.state_dict_metadata[fqn]
    try:
        (dst / ".metadata").write_bytes(pickle.dumps(md))
    except Exception:
        (dst / ".metadata").write_bytes(mutate_pickle_ops(ctx.cache["md"], rng))
    if rng.random() < 0.2:
        distcp = next(dst.glob("*.distcp"))
        data = bytearray(distcp.read_bytes())
        i = rng.randrange(len(data))
        data[i] ^= 0xFF
        distcp.write_bytes(bytes(data))
    return ctx.commands(dst)


def gen_deepspeed(ctx: Ctx) -> list[list[str]]:
    import torch

    src = ctx.seeds.get("deepspeed")
    if src is None:
        return gen_tree(ctx)
    dst = ctx.work / "in_ds"
    _copy_folder(src, dst)
    files = sorted(p for p in dst.rglob("*.pt"))
    target = ctx.rng.choice(files)
    key = str(target.relative_to(dst))
    if key not in ctx.cache:
        ctx.cache[key] = torch.load(target, weights_only=False)  # our own DeepSpeed run's file: trusted
    tree = mutate_tree(_copy_tree(ctx.cache[key]), ctx.rng, ctx.rng.randint(1, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.save(tree, target)
        except Exception:
            pass
    if ctx.rng.random() < 0.1:
        (dst / "latest").write_text(ctx.rng.choice(["../..", "", "\x1b[2J", "global_step" + "9" * 200]))
    return ctx.commands(dst)


def gen_hf(ctx: Ctx) -> list[list[str]]:
    src = ctx.seeds["hf"]
    dst = ctx.work / "in_hf"
    _copy_folder(src, dst)
    rng = ctx.rng
    for _ in range(rng.randint(1, 3)):
        r = rng.random()
        names = sorted(p.name for p in dst.iterdir())
        name = rng.choice(names)
        if r < 0.15:
            p = dst / name
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        elif r < 0.45:
            doc_name = rng.choice(["config.json", "trainer_state.json", "model.safetensors.index.json", "ckptfix.json"])
            doc = {"vocab_size": 48} if doc_name == "config.json" else {}
            if doc_name.endswith("index.json"):
                doc = {"metadata": {"total_size": 100}, "weight_map": {"text_embedding.weight": "model.safetensors"}}
            doc = mutate_json(doc, rng)
            with contextlib.suppress(FileNotFoundError, IsADirectoryError, OSError):
                (dst / doc_name).unlink()
            (dst / doc_name).write_text(json.dumps(doc))
        elif r < 0.6:
            link = dst / rng.choice(["extra.bin", "notes.txt", "model.safetensors", "optimizer.pt", "subdir"])
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                if link.is_dir() and not link.is_symlink():
                    shutil.rmtree(link)
                else:
                    link.unlink()
            os.symlink(rng.choice(["/dev/zero", "/etc/hostname", str(ctx.seeds["pth"]), "..", "missing", "/proc/self"]), link)
        elif r < 0.7:
            p = dst / rng.choice(["zz.fifo", "trainer_state.json", "scaler.pt"])
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
            os.mkfifo(p)
        elif r < 0.8:
            _split_table(dst, rng)
        else:  # a training file replaced by a mutated tree
            import torch

            which = rng.choice(["optimizer.pt", "scheduler.pt", "scaler.pt"])
            with contextlib.suppress(Exception):
                tree = torch.load(src / which, weights_only=True)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    with contextlib.suppress(FileNotFoundError):
                        (dst / which).unlink()
                    torch.save(mutate_tree(_copy_tree(tree), rng, rng.randint(1, 3)), dst / which)
    return ctx.commands(dst)


def _split_table(folder: Path, rng: random.Random) -> None:
    """The weights with an embedding saved in two parts (Molmo2's `wte.embedding` + `wte.new_embedding`, which the
    HF reader joins into one table and repair saves in parts again) of hostile shapes and dtypes, and a config
    stating rows past the vocab that may or may not fit them."""
    import numpy as np
    from safetensors.numpy import save_file

    shapes = [(0, 8), (48, 8), (24, 8), (1, 8), (24, 0), (3, 8, 1), (24,), (5, 9), (40, 8)]
    dtypes = [np.float32, np.float16, np.int64, np.float64]
    tensors = {"wte.embedding": np.ones(rng.choice(shapes), rng.choice(dtypes)),
               "wte.new_embedding": np.ones(rng.choice(shapes), rng.choice(dtypes)),
               "norm.weight": np.ones(8, np.float32)}
    if rng.random() < 0.3:
        tensors["lm_head.weight"] = np.ones(rng.choice(shapes), np.float32)
    with contextlib.suppress(FileNotFoundError, IsADirectoryError, OSError):
        (folder / "model.safetensors").unlink()
    save_file(tensors, str(folder / "model.safetensors"))
    config = {"vocab_size": rng.choice([48, 24, 40, 0, -1]), "additional_vocab_size": rng.choice(
        [24, 0, 8, -3, 2 ** 40, True, "x", None, 48])}
    with contextlib.suppress(FileNotFoundError, IsADirectoryError, OSError):
        (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(config))


def mutate_json(doc: Any, rng: random.Random, rounds: int = 2) -> Any:
    for _ in range(rounds):
        nodes: list[Any] = []
        stack = [doc]
        while stack and len(nodes) < 2000:
            node = stack.pop()
            if isinstance(node, dict):
                nodes.append(node)
                stack.extend(node.values())
            elif isinstance(node, list):
                nodes.append(node)
                stack.extend(node)
        if not nodes:
            return hostile_value_json(rng)
        node = rng.choice(nodes)
        if isinstance(node, dict):
            key = rng.choice(list(node)) if node and rng.random() < 0.8 else rng.choice(["\x1b[2J", "vocab_size", "x"])
            node[key] = hostile_value_json(rng)
        elif node:
            node[rng.randrange(len(node))] = hostile_value_json(rng)
    return doc


def _tok_commands(ctx: Ctx, tok: Path) -> list[list[str]]:
    cmds = [["inspect", str(ctx.seeds["pth"]), "--tokenizer", str(tok), *(["--json"] if ctx.rng.random() < 0.3 else [])]]
    if ctx.rng.random() < 0.2:
        cmds.append(["repair", str(ctx.seeds["pth"]), "--tokenizer", str(tok), "-o", str(ctx.work / "out.pth"),
                     "--init", "zeros"])
    if ctx.rng.random() < 0.1:
        cmds.append(["repair", str(ctx.seeds["pth"]), "--tokenizer", str(ctx.seeds["sentencepiece"]),
                     "--from-tokenizer", str(tok), "--dry-run"])
    return cmds


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _proto_fields(data: bytes) -> list[tuple[int, int, int]]:
    """(start, end, field number) of top-level protobuf fields; stops at damage."""
    from ckptfix.protobuf import varint  # after the sys.path set-up above, as the CLI import below

    out, pos = [], 0
    try:
        while pos < len(data):
            start = pos
            key, pos = varint(data, pos)
            wire = key & 7
            if wire == 0:
                _, pos = varint(data, pos)
            elif wire == 2:
                n, pos = varint(data, pos)
                pos += n
            elif wire == 5:
                pos += 4
            elif wire == 1:
                pos += 8
            else:
                break
            out.append((start, pos, key >> 3))
    except Exception:
        pass
    return out


def gen_sentencepiece(ctx: Ctx) -> list[list[str]]:
    data = bytearray(ctx.seeds["sentencepiece"].read_bytes())
    rng = ctx.rng
    fields = _proto_fields(bytes(data))
    for _ in range(rng.randint(1, 3)):
        if not fields:
            break
        start, end, num = rng.choice(fields)
        r = rng.random()
        if r < 0.3:  # a length prefix set to something else
            key_len = len(_varint((num << 3) | 2))
            data[start + key_len:start + key_len + 1] = _varint(rng.choice([0, 1, 127, 2 ** 31, 2 ** 63, 2 ** 70]))
        elif r < 0.5:
            del data[start:end]
        elif r < 0.65:
            data[start:start] = data[start:end] * rng.choice([2, 100, 5000])
        elif r < 0.8:  # a piece string with control characters / huge
            piece = rng.choice([b"\x1b[2J", b"\xff\xfe", b"a" * 70000, b""])
            inner = b"\x0a" + _varint(len(piece)) + piece + b"\x15\x00\x00\x00\x00\x18" + bytes([rng.randrange(7)])
            data[start:end] = b"\x0a" + _varint(len(inner)) + inner
        else:
            cut = rng.randrange(len(data))
            del data[cut:]
        fields = _proto_fields(bytes(data))
    out = ctx.work / rng.choice(["tok.model", "tokenizer.model.v3", "x.bin"])
    out.write_bytes(bytes(data))
    return _tok_commands(ctx, out)


def gen_tokenizer_json(ctx: Ctx) -> list[list[str]]:
    if "tj" not in ctx.cache:
        ctx.cache["tj"] = ctx.seeds["tokenizer_json"].read_text()
    doc = json.loads(ctx.cache["tj"])
    rng = ctx.rng
    r = rng.random()
    if r < 0.3:
        vocab = doc["model"]["vocab"]
        key = rng.choice(list(vocab))
        vocab[key if rng.random() < 0.7 else rng.choice(["\x1b[2J", "", "a" * 10000])] = rng.choice(
            [-1, 2 ** 40, 2 ** 24, 10 ** 300, "x", None, 1.5, [1], True, 0])
    elif r < 0.55:
        doc["added_tokens"] = rng.choice([None, "x", [{"id": 2 ** 40, "content": "a"}], [{"id": -1, "content": "b"}],
                                          [{"id": 5, "content": None}], [{"content": "\x1b[31m", "id": 70,
                                                                         "special": "yes"}] * 3, [1, 2, 3]])
    else:
        doc = mutate_json(doc, rng, rng.randint(1, 3))
    text = json.dumps(doc)
    if rng.random() < 0.1:
        text = text.replace('"vocab"', '"vocab": {"x": ' + "9" * rng.choice([400, 5000]) + '}, "_v"', 1)
    out = ctx.work / "tokenizer.json"
    out.write_text(text)
    return _tok_commands(ctx, out)


def gen_tokenizer_folder(ctx: Ctx) -> list[list[str]]:
    src = ctx.seeds["tokenizer_folder"]
    dst = ctx.work / "in_tok"
    _copy_folder(src, dst)
    rng = ctx.rng
    names = sorted(p.name for p in dst.iterdir())
    for _ in range(rng.randint(1, 3)):
        r = rng.random()
        name = rng.choice(names + ["vocab.txt", "special_tokens_map.json", "added_tokens.json"])
        p = dst / name
        if r < 0.5 and name.endswith(".json"):
            try:  # never open what an earlier round made a FIFO (the generator has no alarm)
                doc = json.loads(p.read_text()) if p.is_file() and not p.is_symlink() else {}
            except Exception:
                doc = {}
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
            p.write_text(json.dumps(mutate_json(doc, rng)))
        elif r < 0.65:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
            if name == "vocab.txt":
                p.write_text("\n".join(rng.choice(["[PAD]", "\x1b[2J", "", "a" * 1000, "w"]) for _ in range(60)))
        elif r < 0.75:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
            os.symlink(rng.choice(["/dev/zero", "/dev/urandom", "..", "missing", "/etc/hostname"]), p)
        elif r < 0.85:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
            os.mkfifo(p)
        else:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
            p.write_bytes(os.urandom(rng.randint(0, 3000)))
    return _tok_commands(ctx, dst)


# --- the hostile grammar (issue 28): classes built whole, not mutated --------------------------------
#
# Mutation rarely assembles a whole hostile class (a MARK/POP desync, then a 300k-deep tuple, then a dict that
# hashes it). These productions build each class on a real seed, so the next input of a class is found here
# first. `GRAMMAR[fmt]` lists a format's productions; `grammar_share` of each format's inputs come from them.
# Classes: deep hashed keys, big digits, claimed counts (issue 28 items 5-6). The copyreg calls, links inside
# folders and restore lists of items 1-4 go in the same table, as productions of their formats.

GRAMMAR_SHARE = 0.3
DESYNC = b"(K\x01(0"  # MARK, 1, MARK, POP: the C unpickler pops the MARK, leaving [MARK, 1]


def _g(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _u(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _deep_key_ops(rng: random.Random) -> bytes:
    """A hashable key that is deep: TUPLE1 chains (after a desync or not), DAGs, frozensets and torch.Size
    of them, an OrderedDict / set built from them."""
    depth = rng.choice([50, 100, 101, 1000, 100_000, 300_000])
    kind = rng.random()
    if kind < 0.35:
        return DESYNC + b"\x85" * depth + b"t"  # ((((1,),...),) closing the MARK left by the desync
    if kind < 0.55:
        return b")" + b"\x85" * depth
    if kind < 0.7:
        return b"K\x01" + b"2\x86" * rng.randint(15, 60)  # DUP + TUPLE2: a memo-free DAG
    if kind < 0.85:
        builder = rng.choice([("builtins", "frozenset"), ("torch", "Size"), ("builtins", "set")])
        return _g(*builder) + b"](" + b")" + b"\x85" * depth + b"e" + b"\x85R"  # builder([deep])
    return (DESYNC + b"0" * rng.randint(1, 3) + b"\x85" * depth + b"t")  # over-popping: the C unpickler refuses


def _big_digits_ops(rng: random.Random) -> bytes:
    n = rng.choice([19, 300, 321, 4300, 4301, 5000, 100_000])
    kind = rng.random()
    if kind < 0.4:
        return b"I" + b"9" * n + b"\n"
    if kind < 0.7:
        return b"L" + b"-" * rng.randint(0, 1) + b"7" * n + b"L\n"
    raw = (10 ** min(n, 5000)).to_bytes((int(min(n, 5000) * 3.33) + 16) // 8, "little", signed=True)
    return b"\x8b" + struct.pack("<i", len(raw)) + raw  # LONG4


def _claim_ops(rng: random.Random) -> bytes:
    """Counts the bytes do not back: memo indexes, string lengths, numpy shapes."""
    kind = rng.random()
    big = (1 << 40) - 1
    if kind < 0.3:
        index = rng.choice([10 ** 8, 2 ** 32 - 1, 2 ** 31])
        return (DESYNC + b"\x85t" if rng.random() < 0.5 else b"K\x01") + b"r" + struct.pack("<I", index)
    if kind < 0.5:
        return rng.choice([b"X\xff\xff\xff\x7f", b"\x8e" + struct.pack("<Q", 1 << 40), b"B\x00\x00\x00\x80"])
    if kind < 0.8:
        shape = rng.choice([(0, big, big), (big,), (2 ** 62, 0), (3,), (1, 1, 1) * 12])
        dims = b"(" + b"".join(_int_bytes(d) for d in shape) + b"t"
        data = b"C\x00" if rng.random() < 0.7 else b"C\x0c" + bytes(12)
        return (_g("numpy.core.multiarray", "_reconstruct") + b"(" + _g("numpy", "ndarray") + b"K\x00\x85C\x01btR"
                + b"(K\x01" + dims + _dtype_ops(rng.choice(["f4", "f3", "u3", "O"])) + b"\x89" + data + b"tb")
    return _g("datetime", "timedelta") + b"(" + _int_bytes(rng.choice([big, -big, 10 ** 9, 86399])) + b"K\x00K\x00tR"


def _dtype_ops(code: str) -> bytes:
    return (_g("numpy", "dtype") + b"(" + _u(code) + b"\x89\x88tR"
            + b"(K\x03" + _u("<") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb")


def _int_bytes(n: int) -> bytes:
    if 0 <= n < 256:
        return b"K" + bytes([n])
    if -(1 << 31) <= n < (1 << 31):
        return b"J" + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _data_ops(rng: random.Random) -> bytes:
    """Data classes given what their reason does not assume: numpy codes numpy rejects, deep Namespaces."""
    if rng.random() < 0.5:
        code = rng.choice(["f3", "c1", "i0", "u3", "f8", "b1", "c32", "f16"])
        raw = bytes(rng.choice([1, 3, 8, 16]))
        return _g("numpy.core.multiarray", "scalar") + b"(" + _dtype_ops(code) + b"C" + bytes([len(raw)]) + raw + b"tR"
    depth = rng.choice([50, 99, 101, 400, 5000])
    return (_g("argparse", "Namespace") + b")\x81}" + _u("a")) * depth + b"K\x01" + b"sb" * depth


_CODE_CLASSES = [("subprocess", "Popen"), ("builtins", "object"), ("argparse", "Namespace"), ("numpy", "ndarray"),
                 ("posix", "system"), ("numpy", "memmap"), ("pathlib", "PosixPath"), ("builtins", "eval")]


def _code_call_ops(rng: random.Random) -> bytes:
    """Calls the data list names, given what its reasons do not assume (issue 28 item 1): copyreg's
    `_reconstructor(cls, base, state)` with any class and base, NEWOBJ of a class with arguments
    (`cls.__new__(cls, *args)`), a data call given a class or a function as argument."""
    cls, base = _g(*rng.choice(_CODE_CLASSES)), _g(*rng.choice(_CODE_CLASSES))
    state = rng.choice([b"N", b"](" + _u("touch") + _u("/nonexistent/x") + b"e", _u("f8"), b"K\x01"])
    kind = rng.random()
    if kind < 0.4:
        return _g("copyreg", "_reconstructor") + b"(" + cls + base + state + b"tR"
    if kind < 0.7:
        return cls + b"(" + state + _u("w+") + b"t\x81"  # NEWOBJ
    target = rng.choice([("pathlib", "PosixPath"), ("numpy", "dtype"), ("collections", "defaultdict"),
                         ("datetime", "timedelta"), ("collections", "deque")])
    return _g(*target) + b"(" + cls + b"tR"


def _hostile_entry(rng: random.Random) -> bytes:
    """`key value SETITEM` ops for the top dict: a hostile key, or a hostile value under a plain key."""
    kind = rng.random()
    if kind < 0.3:
        return _deep_key_ops(rng) + b"K\x01s"
    value = (_big_digits_ops(rng) if kind < 0.45 else _claim_ops(rng) if kind < 0.65 else _data_ops(rng)
             if kind < 0.8 else _code_call_ops(rng))
    return _u("extra") + value + b"s"


def _seed_pickle(ctx: Ctx) -> bytes:
    if "members" not in ctx.cache:
        members = _zip_members(ctx.seeds["pth"].read_bytes())
        pkl = next(body for name, body in members if name.endswith("/data.pkl"))
        ctx.cache.update(members=members, pkl=pkl, parsed=parse_pickle_ops(pkl))
    return ctx.cache["pkl"]


def grammar_pickle(ctx: Ctx) -> list[list[str]]:
    """The seed's data.pkl with one to three hostile entries added to its top dict, as a zip or a raw pickle."""
    pkl = _seed_pickle(ctx)
    assert pkl.endswith(b".")
    body = pkl[:-1] + b"".join(_hostile_entry(ctx.rng) for _ in range(ctx.rng.randint(1, 3))) + b"."
    out = ctx.work / "in.pth"
    out.write_bytes(_with_pkl(ctx.cache["members"], body) if ctx.rng.random() < 0.8 else body)
    return ctx.commands(out) + ([["convert", str(out), "-o", str(ctx.work / "out.pth")]] if ctx.rng.random() < 0.3 else [])


def grammar_tree(ctx: Ctx) -> list[list[str]]:
    """Trees torch.save writes that numpy or the C stack cannot take whole: empty 2**62 dimensions, expanded
    (stride-0) views named like lora_B, Namespaces nested near the recursion limit."""
    import argparse

    import torch

    rng = ctx.rng
    if "model" not in ctx.cache:
        ctx.cache["model"] = torch.load(ctx.seeds["pth"], weights_only=True).get("model", {})
    tree: dict[str, Any] = {"model": dict(ctx.cache["model"])}
    kind = rng.random()
    if kind < 0.4:
        tree["model"]["x"] = torch.empty(*rng.choice([(0, 2 ** 62), (2 ** 62, 0), (0, 2 ** 31, 2 ** 31)]))
    elif kind < 0.7:
        tree["model"]["q.lora_B.weight"] = torch.zeros(64).expand(rng.choice([1 << 20, 1 << 24]), 64)
        tree["model"]["q.lora_A.weight"] = torch.zeros(8, 8)
    else:
        ns: Any = 1
        for _ in range(rng.choice([50, 100, 150])):  # torch.save itself recurses ~3 frames per level
            ns = argparse.Namespace(a=ns)
        tree["hyper_parameters"] = {"args": ns}
    out = ctx.work / "in.pth"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save(tree, out, _use_new_zipfile_serialization=rng.random() < 0.8)
    return ctx.commands(out) + ([["convert", str(out), "-o", str(ctx.work / "out.pth")]] if rng.random() < 0.3 else [])


def grammar_zip(ctx: Ctx) -> list[list[str]]:
    """Archives torch.save never writes: a NUL in a name, members over the same bytes, a record longer than its
    storage, another byte order, a deflated data.pkl claiming fewer bytes than it inflates to."""
    rng = ctx.rng
    data = bytearray(ctx.seeds["pth"].read_bytes())
    infos = zipfile.ZipFile(io.BytesIO(bytes(data))).infolist()
    kind = rng.random()
    if kind < 0.2:  # a NUL in a name (local header and central directory alike)
        info = rng.choice(infos)
        name = info.filename.encode()
        pos = rng.randrange(len(name) - 1)
        data = bytearray(bytes(data).replace(name, name[:pos] + b"\x00" + name[pos + 1:]))
    elif kind < 0.4:  # a central directory entry pointed at another member's local header
        a, b = rng.sample(infos, 2)
        cd = _central_entry(data, b.filename)
        if cd is not None:
            struct.pack_into("<I", data, cd + 42, a.header_offset)
    elif kind < 0.6:  # a record longer (or shorter) than its storage
        members = _zip_members(bytes(data))
        records = [n for n, _ in members if "/data/" in n and not n.endswith("serialization_id")]
        name = rng.choice(records) if records else members[-1][0]
        extra = rng.choice([1, 16, 4096])
        data = bytearray(_rezip([(n, b + bytes(extra) if n == name else b) for n, b in members]))
    elif kind < 0.8:  # byteorder
        members = _zip_members(bytes(data))
        order = rng.choice([b"big", b"", b"middle", b"little\n", b"\x1b[2J"])
        data = bytearray(_rezip([(n, order if n.endswith("/byteorder") else b) for n, b in members]))
    else:  # a deflated data.pkl with zeros after its STOP, its sizes claiming the pickle alone
        members = _zip_members(bytes(data))
        name = next(n for n, _ in members if n.endswith("/data.pkl"))
        pkl = dict(members)[name]
        data = bytearray(_rezip([(n, b + bytes(rng.choice([1 << 20, 64 << 20])) if n == name else b)
                                 for n, b in members], deflate=name))
        info = zipfile.ZipFile(io.BytesIO(bytes(data))).getinfo(name)
        struct.pack_into("<I", data, info.header_offset + 22, len(pkl))
        cd = _central_entry(data, name)
        if cd is not None:
            struct.pack_into("<I", data, cd + 24, len(pkl))
    out = ctx.work / "in.pth"
    out.write_bytes(bytes(data))
    return ctx.commands(out)


def _central_entry(data: bytearray, name: str) -> int | None:
    at = -1
    while (at := data.find(b"PK\x01\x02", at + 1)) >= 0:
        n = struct.unpack_from("<H", data, at + 28)[0]
        if data[at + 46:at + 46 + n] == name.encode():
            return at
    return None


def _rezip(members: list[tuple[str, bytes]], deflate: str = "") -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for name, body in members:
            zf.writestr(name, body, zipfile.ZIP_DEFLATED if name == deflate else zipfile.ZIP_STORED)
    return out.getvalue()


def grammar_safetensors(ctx: Ctx) -> list[list[str]]:
    """What the safetensors library refuses: gaps, trailing bytes, non-string metadata, bool or claimed dims."""
    rng = ctx.rng
    raw = ctx.seeds["safetensors"].read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header, body = json.loads(raw[8:8 + n]), raw[8 + n:]
    names = [k for k in header if k != "__metadata__"]
    kind = rng.random()
    if kind < 0.25:  # a gap: every tensor after one moved on by k bytes
        cut, k = rng.randrange(len(names)), rng.choice([1, 8, 4096])
        start = header[names[cut]]["data_offsets"][0]
        for name in names:
            offsets = header[name]["data_offsets"]
            if offsets[0] >= start:
                header[name]["data_offsets"] = [offsets[0] + k, offsets[1] + k]
        body = body[:start] + rng.choice([bytes(k), pickle.dumps(("x",) * k)[:k].ljust(k, b"\x00")]) + body[start:]
    elif kind < 0.45:
        body += bytes(rng.choice([1, 7, 1 << 16]))
    elif kind < 0.7:
        header["__metadata__"] = rng.choice([{"format": 1}, {"a": None}, {"a": ["x"]}, {"a": {"b": "c"}}, ["x"], "x",
                                             {"a": "@DIGITS@"}])
    else:
        name = rng.choice(names)
        header[name]["shape"] = rng.choice([[True, 1], [False], [0, 2 ** 62], [2 ** 62, 0, 2 ** 62],
                                            [1] + header[name]["shape"]])
    text = json.dumps(header).encode().replace(b'"@DIGITS@"', b"9" * 5000)  # json.dumps cannot write 5000 digits
    out = ctx.work / "in.safetensors"
    out.write_bytes(len(text).to_bytes(8, "little") + text + body)
    return ctx.commands(out)


def grammar_dcp(ctx: Ctx) -> list[list[str]]:
    """A real dcp.save folder whose .metadata carries a DAG (transform descriptors, planner paths) or whose
    whole .metadata is a hostile pickle of the grammar."""
    src = ctx.seeds["dcp"]
    dst = ctx.work / "in_dcp"
    _copy_folder(src, dst)
    rng = ctx.rng
    if rng.random() < 0.5:
        md = pickle.loads((src / ".metadata").read_bytes())  # our own file, written by dcp.save above: trusted
        for info in md.storage_data.values():
            if rng.random() < 0.5:
                info.transform_descriptors = rng.choice([_dag(rng.randint(20, 40)), ["zstd"] * 100, [1], "x",
                                                         ["a" * 10_000]])
        (dst / ".metadata").write_bytes(pickle.dumps(md))
    else:
        (dst / ".metadata").write_bytes(b"\x80\x02}" + b"".join(_hostile_entry(rng) for _ in range(2)) + b".")
    return ctx.commands(dst)


def grammar_hf(ctx: Ctx) -> list[list[str]]:
    """An HF folder whose index names one shard many ways, or whose pickles carry the grammar's entries."""
    src = ctx.seeds["hf"]
    dst = ctx.work / "in_hf"
    _copy_folder(src, dst)
    rng = ctx.rng
    if rng.random() < 0.5:
        from ckptfix.formats.safetensors_file import read_header

        names = list(read_header(str(dst / "model.safetensors"))[0])
        spellings = rng.choice([400, 50])
        weight_map = {n: "./" * (i % spellings) + "model.safetensors" for i, n in enumerate(names * 20)}
        weight_map = {f"{n}.{i}" if i else n: s for i, (n, s) in enumerate(weight_map.items())}
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        which = rng.choice(["optimizer.pt", "scheduler.pt", "training_args.bin"])
        body = b"\x80\x02}" + b"".join(_hostile_entry(rng) for _ in range(2)) + b"."
        (dst / which).write_bytes(_with_pkl(_zip_members(_torch_bytes({})), body) if rng.random() < 0.5 else body)
    return ctx.commands(dst)


def grammar_tokenizer(ctx: Ctx) -> list[list[str]]:
    """Tokenizer files whose counts claim what their bytes do not hold, or that cost more than linear work:
    sparse tiktoken ranks and vocab.json ids, tekken special counts, 5000-digit decoder keys, tens of
    thousands of added tokens, RWKV literals nested deep."""
    rng = ctx.rng
    kind = rng.random()
    top = rng.choice([16_777_215, 1 << 20, 70_000, 1000])
    if kind < 0.15:
        out = ctx.work / "x.tiktoken"
        out.write_bytes(b"YQ== " + str(top).encode() + b"\n" + (b"Yg== 0\n" if rng.random() < 0.5 else b""))
    elif kind < 0.3:
        (ctx.work / "enc").mkdir()
        out = ctx.work / "enc" / "vocab.json"
        out.write_text(json.dumps({"a": top, **({"b": 0} if rng.random() < 0.5 else {})}))
    elif kind < 0.45:
        out = ctx.work / "tekken.json"
        n_special = rng.choice([top - 1, 1000, 70_000])
        out.write_text(json.dumps({"config": {"pattern": "x", "default_vocab_size": top,
                                              "default_num_special_tokens": min(n_special, top), "version": "v7"},
                                   "vocab": [{"rank": i, "token_bytes": "YQ=="} for i in range(rng.choice([0, 3]))]}))
    elif kind < 0.6:
        out = ctx.work / "tokfolder"
        _copy_folder(ctx.seeds["tokenizer_folder"], out)
        config = out / "tokenizer_config.json"
        doc = json.loads(config.read_text()) if config.is_file() else {}
        doc["added_tokens_decoder"] = {rng.choice(["9" * 5000, "9" * 9, "1" + "0" * 8, "-1", "٣"]): {"content": "x"}}
        config.write_text(json.dumps(doc))
    elif kind < 0.8:
        doc = json.loads(ctx.seeds["tokenizer_json"].read_text())
        doc["added_tokens"] = [{"id": 100 + i, "content": f"<x{i}>", "special": i % 2 == 0} for i in
                               range(rng.choice([5_000, 30_000]))]
        out = ctx.work / "tokenizer.json"
        out.write_text(json.dumps(doc))
    else:
        out = ctx.work / "rwkv_vocab_v20230424.txt"
        literal = rng.choice(["'a' if " + "-" * 100_000 + "1 else ''", "'" + "a" * 2000 + "'", "'\\x" + "'",
                              "b'" + "(" * 300 + "'"])
        out.write_text(f"1 'a' 1\n2 {literal} 1\n")
    return _tok_commands(ctx, out)


# The names an in-place repair writes or keeps (issue 28 item 2): a link planted under one must never be written
# through. Folders named `out*` are not watched (an in-place repair changes them by design); `elsewhere/`, the
# links' targets, is.
_IN_PLACE_NAMES = ["ckptfix.json", "ckptfix.json.ckptfix-tmp", "ckptfix-restore.json",
                   "ckptfix-restore.json.ckptfix-tmp", ".metadata.ckptfix-bak", "..metadata.ckptfix-tmp",
                   "model.safetensors.index.json.ckptfix-tmp", "config.json.ckptfix-bak", "__ckptfix0_0.distcp",
                   ".__ckptfix0_0.distcp.metadata", "tokenizer.model"]


def grammar_links(ctx: Ctx) -> list[list[str]]:
    """A DCP or HF folder with links planted under the names an in-place repair uses, or a data file replaced by
    a link out of the folder; repaired in place (then restored), into a new folder, and inspected."""
    rng = ctx.rng
    kind = rng.choice(["dcp", "hf"])
    folder = ctx.work / "out_inplace"
    _copy_folder(ctx.seeds[kind], folder)
    outside = ctx.work / "elsewhere"
    outside.mkdir(exist_ok=True)
    for name in rng.sample(_IN_PLACE_NAMES, rng.randint(1, 4)):
        target = outside / f"victim-{len(list(outside.iterdir()))}"
        target.write_bytes(b"precious")
        if not os.path.lexists(folder / name):
            os.symlink(rng.choice([str(target), "/dev/zero", "../elsewhere", "missing"]), folder / name)
    if rng.random() < 0.3:  # a file the reader needs, moved out and linked back
        data = rng.choice([p for p in folder.iterdir() if p.is_file() and not p.is_symlink()])
        shutil.move(data, outside / data.name)
        os.symlink(outside / data.name, data)
    tok = str(ctx.seeds["sentencepiece"])
    return [["inspect", str(folder)], ["repair", str(folder), "-t", tok, "--in-place", "--keep-ids"],
            ["restore", str(folder)], ["repair", str(folder), "-t", tok, "-o", str(ctx.work / "out")]]


def grammar_restore(ctx: Ctx) -> list[list[str]]:
    """`ckptfix restore` of a folder whose restore list is mutated, typed wrong, a link or a FIFO, or names
    files outside, a referenced data file, escapes (issue 28 item 4)."""
    rng = ctx.rng
    folder = ctx.work / "out_restore"
    _copy_folder(ctx.seeds["dcp"], folder)
    data = sorted(p.name for p in folder.iterdir() if p.name.endswith(".distcp"))
    shutil.copy(folder / ".metadata", folder / ".metadata.ckptfix-bak")
    doc: Any = {"switch": ".metadata", "backups": {".metadata": ".metadata.ckptfix-bak"},
                "added": rng.sample(data, min(len(data), rng.randint(0, 2)))}
    extra = rng.choice(["../elsewhere/victim", "a\x00b", "\x1b[31m", "x" * 300, ".", "..", "/etc/hostname", 7, None])
    if rng.random() < 0.5:
        doc["added"].append(extra)
    if rng.random() < 0.5:
        doc = mutate_json(doc, rng)
    record = folder / "ckptfix-restore.json"
    form = rng.random()
    if form < 0.1:
        os.symlink(rng.choice(["/dev/zero", "../elsewhere/victim", "missing"]), record)
    elif form < 0.15:
        os.mkfifo(record)
    else:
        record.write_text(json.dumps(doc) if rng.random() < 0.9 else "[" * 100_000)
    outside = ctx.work / "elsewhere"
    outside.mkdir(exist_ok=True)
    (outside / "victim").write_bytes(b"precious")
    return [["restore", str(folder)]]


# --- issue 44 item 3: the kinds of value a reader expects, paths, and counts -----------------------------
#
# Each structure a reader takes (trainer_state.json, config.json, the safetensors index, the ckptfix record, an
# optimizer state, DCP's dataclasses) given a list where it expects a dict and a dict where it expects a list;
# empty tensors with a 2**62 dimension; storage paths that are relative, name the folder, or loop; and counts
# of 10^5 and more where a reader's cost per entry shows (header entries, index entries, distinct steps).

EMPTY_HUGE = [(0, 2 ** 62), (2 ** 62, 0), (0, 2 ** 48 + 1), (2 ** 40, 0, 2 ** 40)]


def _swapped(node: Any, rng: random.Random, str_keys: bool) -> Any:
    """A dict as a list (of its values, or of its items as pairs); a list or tuple as a dict keyed by position
    (or the other sequence kind)."""
    if isinstance(node, dict):
        return rng.choice([list(node.values()), [list(kv) for kv in node.items()], tuple(node.values())])
    if isinstance(node, (list, tuple)):
        if rng.random() < 0.25:
            return tuple(node) if isinstance(node, list) else list(node)
        return {(str(i) if str_keys else i): v for i, v in enumerate(node)}
    return rng.choice([[node], {"value": node}])


def swap_kinds(doc: Any, rng: random.Random, rounds: int = 1, str_keys: bool = True) -> Any:
    """`doc` with `rounds` of its containers (the whole document included) replaced by the other kind: a list
    where a dict was, a dict where a list or tuple was (`_swapped`). Returns the new document."""
    for _ in range(rounds):
        spots: list[tuple[Any, Any]] = [(None, None)]
        stack = [doc]
        while stack and len(spots) < 2000:
            node = stack.pop()
            pairs = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
            for key, child in pairs:
                if isinstance(child, (dict, list, tuple)):
                    spots.append((node, key))
                    if not isinstance(child, tuple):
                        stack.append(child)
        parent, key = rng.choice(spots)
        if parent is None:
            doc = _swapped(doc, rng, str_keys)
        else:
            parent[key] = _swapped(parent[key], rng, str_keys)
    return doc


def _record_doc() -> dict[str, Any]:
    """A repair record's shape (`ckptfix.record`): what a record sidecar or a tree's "ckptfix" key holds."""
    return {"schema": "ckptfix.repair/1", "ckptfix_version": "0.1", "source": {"path": "ckpt.pth", "sha256": None},
            "tokenizer": {"path": "tok.model", "size": 56, "fingerprint": "x"}, "policy": "remap",
            "rows": {"old": 48, "new": 56, "kept": 48, "moved": [[1, 2]], "added": [48, 49]},
            "tensors": {"wte.weight": {"old": [48, 8], "new": [56, 8]}}, "notes": ["a note"]}


class _SwappedStatePickler(pickle.Pickler):
    """Pickles DCP metadata with the state of the objects in `targets` (by id) of the other kind: a dataclass's
    fields as a list or tuple instead of a dict, TensorProperties' tuple as a dict or a list."""

    def __init__(self, f: Any, targets: set[int], rng: random.Random):
        super().__init__(f, protocol=2)
        self.targets, self.rng = targets, rng

    def reducer_override(self, obj: Any) -> Any:
        if id(obj) not in self.targets:
            return NotImplemented
        func, args, state = obj.__reduce_ex__(2)[:3]
        return func, args, _swapped(state, self.rng, str_keys=True)


def _dcp_objects(md: Any) -> list[Any]:
    """The dataclass instances of a DCP Metadata: itself, each storage metadata, its properties and chunks, each
    storage index and storage info."""
    found = [md]
    for entry in md.state_dict_metadata.values():
        found.append(entry)
        found.extend([entry.properties, *entry.chunks] if hasattr(entry, "chunks") else [])
    for index, info in md.storage_data.items():
        found.extend([index, info])
    return found


def grammar_kinds(ctx: Ctx) -> list[list[str]]:
    """A structure a reader takes, given the other kind of container somewhere: the HF folder's JSON files and
    record, its optimizer/scheduler state (and empty tensors of 2**62 rows among the moments), a torch tree's
    optimizer and "ckptfix" record, a DCP .metadata's dataclasses (fields, TensorProperties) or its sizes."""
    import torch

    rng = ctx.rng
    kind = rng.choice(["hf_json", "hf_state", "tree", "dcp"])
    if kind == "dcp":
        folder = ctx.work / "in_dcp"
        _copy_folder(ctx.seeds["dcp"], folder)
        md = pickle.loads((ctx.seeds["dcp"] / ".metadata").read_bytes())  # our own dcp.save: trusted
        if rng.random() < 0.3:  # an empty tensor with a dimension of 2**62, its chunk alike
            entry = rng.choice([e for e in md.state_dict_metadata.values() if hasattr(e, "chunks")])
            shape = torch.Size(rng.choice(EMPTY_HUGE))
            object.__setattr__(entry, "size", shape)
            entry.chunks[0] = type(entry.chunks[0])(offsets=torch.Size([0] * len(shape)), sizes=shape)
        objects = _dcp_objects(md)
        targets = {id(o) for o in rng.sample(objects, rng.randint(1, 2))}
        buf = io.BytesIO()
        _SwappedStatePickler(buf, targets, rng).dump(md)
        (folder / ".metadata").write_bytes(buf.getvalue())
        return ctx.commands(folder)
    if kind == "tree":
        tree = _copy_tree(ctx.cache.setdefault("kinds_tree", torch.load(ctx.seeds["pth"], weights_only=True)))
        tree["ckptfix"] = _record_doc()
        section = rng.choice([k for k in ("optimizer", "scheduler", "scaler", "ckptfix") if k in tree])
        tree[section] = swap_kinds(tree[section], rng, rng.randint(1, 2), str_keys=False)
        out = ctx.work / "in.pth"
        torch.save(tree, out)
        return ctx.commands(out)
    folder = ctx.work / "in_hf"
    _copy_folder(ctx.seeds["hf"], folder)
    if kind == "hf_json":
        name = rng.choice(["trainer_state.json", "config.json", "model.safetensors.index.json", "ckptfix.json"])
        doc: Any = {"trainer_state.json": {"global_step": 3, "max_steps": 10, "log_history": [{"loss": 1.0, "step": 3}],
                                           "best_model_checkpoint": None},
                    "config.json": {"vocab_size": 48, "model_type": "tiny", "hidden_size": 8, "architectures": ["X"]},
                    "model.safetensors.index.json": {"metadata": {"total_size": 100},
                                                     "weight_map": {"text_embedding.weight": "model.safetensors"}},
                    "ckptfix.json": _record_doc()}[name]
        with contextlib.suppress(FileNotFoundError):
            (folder / name).unlink()
        (folder / name).write_text(json.dumps(swap_kinds(doc, rng, rng.randint(1, 2))))
        return ctx.commands(folder)
    which = rng.choice(["optimizer.pt", "scheduler.pt", "scaler.pt"])
    tree = _copy_tree(torch.load(folder / which, weights_only=True))
    if which == "optimizer.pt" and rng.random() < 0.3:  # moments of an empty tensor with a 2**62 dimension
        entry = next(iter(tree["state"].values()))
        for key in ("exp_avg", "exp_avg_sq"):
            entry[key] = torch.empty(*rng.choice(EMPTY_HUGE))
    else:
        tree = swap_kinds(tree, rng, rng.randint(1, 2), str_keys=False)
    (folder / which).unlink()
    torch.save(tree, folder / which)
    return ctx.commands(folder)


#: Storage paths torch joins to the folder (`./x`, `sub/../x`, `x/`) and ones naming no file in it.
_DCP_PATHS = ["./__0_0.distcp", "sub/../__0_0.distcp", "__0_0.distcp/", ".//__0_0.distcp", ".", "", "./sub/..", "sub",
              "loop", "self", "a", "fifo", "loop/__0_0.distcp", "sub/../../x"]
_HF_PATHS = ["./model.safetensors", "sub/../model.safetensors", "model.safetensors/", ".", "", "sub", "loop", "self",
             "a", "loop/model.safetensors", "../checkpoint-3/model.safetensors"]


def _plant_loops(folder: Path) -> None:
    (folder / "sub").mkdir(exist_ok=True)
    for name, target in (("loop", "."), ("self", "self"), ("a", "b"), ("b", "a")):
        if not os.path.lexists(folder / name):
            os.symlink(target, folder / name)
    if not os.path.lexists(folder / "fifo"):
        os.mkfifo(folder / "fifo")


def grammar_paths(ctx: Ctx) -> list[list[str]]:
    """DCP storage paths and HF index shard names that are relative, name the folder itself, climb out, or go
    through a link loop; sometimes the data file itself replaced by a loop. Inspected (--scan), repaired into a
    new folder, and for DCP in place then restored (the folder is named out_*: an in-place repair changes it)."""
    rng = ctx.rng
    kind = rng.choice(["dcp", "hf"])
    folder = ctx.work / ("out_paths" if kind == "dcp" else "in_hf")
    _copy_folder(ctx.seeds[kind], folder)
    _plant_loops(folder)
    tok = str(ctx.seeds["sentencepiece"])
    if kind == "dcp":
        md = pickle.loads((ctx.seeds["dcp"] / ".metadata").read_bytes())  # our own dcp.save: trusted
        rel = rng.choice(_DCP_PATHS)
        for info in md.storage_data.values():
            if rng.random() < 0.7:
                info.relative_path = rel
        (folder / ".metadata").write_bytes(pickle.dumps(md))
        if rng.random() < 0.2:  # the data file's own name a loop
            (folder / "__0_0.distcp").unlink()
            os.symlink(rng.choice(["__0_0.distcp", ".", "loop/__0_0.distcp"]), folder / "__0_0.distcp")
        cmds = [["inspect", str(folder), "--scan"], ["repair", str(folder), "-t", tok, "-o", str(ctx.work / "out")]]
        if rng.random() < 0.5:
            cmds += [["repair", str(folder), "-t", tok, "--in-place", "--keep-ids"], ["restore", str(folder)]]
        return cmds
    names = ["text_embedding.weight", "text_head.weight", "norm.weight"]
    weight_map = {n: rng.choice(_HF_PATHS) for n in names}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return [["inspect", str(folder), "--scan"], ["repair", str(folder), "-t", tok, "-o", str(ctx.work / "out")]]


#: The counts of `grammar_many`: 10^5 and more where a reader's cost per entry shows; half the time a smaller
#: count of the same structure (the CI slice meets both, the long run mostly the large).
MANY = [100_000, 150_000, 300_000]
FEW = [1_000, 10_000]


def _many(ctx: Ctx, key: str, make: Callable[[int], bytes], n: int) -> bytes:
    """`make(n)`'s bytes, made once per process (a 300,000-entry header or a 100,000-step torch.save takes
    seconds to write; every input of that count reuses them)."""
    cache = _CACHES.setdefault("many", {})
    if (key, n) not in cache:
        cache[(key, n)] = make(n)
    return cache[(key, n)]


def _many_safetensors(n: int) -> bytes:
    text = json.dumps({f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
                       for i in range(n)}, separators=(",", ":")).encode()
    return struct.pack("<Q", len(text)) + text + bytes(4 * n)


def _many_steps(n: int, tensors: bool) -> bytes:
    import torch

    model = {"embed.weight": torch.zeros(16, 8), "head.weight": torch.zeros(8, 16)}
    state = {i: {"step": torch.tensor(float(i)) if tensors else float(i)} for i in range(n)}
    return _torch_bytes({"model": model, "optimizer": {"state": state,
                                                      "param_groups": [{"lr": 1e-3, "params": list(range(n))}]}})


def _many_dcp_metadata(src: Path, n: int) -> bytes:
    """The seed's .metadata with n more scalar entries, each its own storage item (`optim.state.i.step`)."""
    md = pickle.loads((src / ".metadata").read_bytes())  # our own dcp.save: trusted
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    some = next(iter(md.storage_data.values()))
    for i in range(n):
        fqn = f"extra.{i}.step"
        md.state_dict_metadata[fqn] = BytesStorageMetadata()
        md.storage_data[MetadataIndex(fqn)] = copy.copy(some)
    return pickle.dumps(md)


def grammar_many(ctx: Ctx) -> list[list[str]]:
    """10^5 and more where one or a few are expected: a safetensors header of that many tensors, an optimizer
    state of that many entries each with its own step (float or tensor), an HF index naming that many weights,
    a DCP .metadata of that many items; sometimes one entry made hostile. Inspected only (--json sometimes)."""
    rng = ctx.rng
    n = rng.choice(MANY if rng.random() < 0.5 else FEW)
    kind = rng.choice(["safetensors", "steps", "hf", "dcp"])
    flags = ["--json"] if rng.random() < 0.3 else []
    if kind == "safetensors":
        data = _many(ctx, "safetensors", _many_safetensors, n)
        if rng.random() < 0.3:  # one entry's shape hostile: refused where it stands, not after the rest
            at = data.find(b'"shape":[1]', rng.randrange(8, len(data) // 2))
            if at > 0:
                data = data[:at] + b'"shape":[0]' + data[at + 11:]
        out = ctx.work / "in.safetensors"
        out.write_bytes(data)
        return [["inspect", str(out), *flags]]
    if kind == "steps":
        tensors = rng.random() < 0.5
        n = min(n, 100_000) if tensors else n  # 10^5 step tensors: a 27 MB archive of 100,000 records
        out = ctx.work / "in.pth"
        out.write_bytes(_many(ctx, f"steps-{tensors}", lambda k: _many_steps(k, tensors), n))
        return [["inspect", str(out), *flags]]
    if kind == "hf":
        folder = ctx.work / "in_hf"
        _copy_folder(ctx.seeds["hf"], folder)
        weight_map = {f"layers.{i}.weight": "model.safetensors" for i in range(n)}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        return [["inspect", str(folder), *flags]]
    folder = ctx.work / "in_dcp"
    _copy_folder(ctx.seeds["dcp"], folder)
    (folder / ".metadata").write_bytes(_many(ctx, "dcp", lambda k: _many_dcp_metadata(ctx.seeds["dcp"], k),
                                             min(n, 100_000)))
    return [["inspect", str(folder), *flags]]


# Per format, its productions: copyreg calls ride in the pickle entries (`_code_call_ops`), links inside
# folders in "hf"/"dcp", restore lists with "dcp".
GRAMMAR: dict[str, list[Callable[[Ctx], list[list[str]]]]] = {
    "pickle": [grammar_pickle], "tree": [grammar_tree, grammar_kinds, grammar_many], "zip": [grammar_zip],
    "safetensors": [grammar_safetensors, grammar_many], "dcp": [grammar_dcp, grammar_links, grammar_restore,
                                                                grammar_kinds, grammar_paths],
    "deepspeed": [grammar_tree], "hf": [grammar_hf, grammar_links, grammar_kinds, grammar_paths, grammar_many],
    "sentencepiece": [grammar_tokenizer], "tokenizer_json": [grammar_tokenizer], "tokenizer_folder": [grammar_tokenizer],
}
#: The productions of issue 44 item 3, by name: `python tests/fuzz_structured.py FORMAT N SEED --only kinds,paths,many`
#: runs these alone (every input a grammar input of these classes).
ISSUE44 = {"kinds": grammar_kinds, "paths": grammar_paths, "many": grammar_many}


def _with_grammar(fmt: str, gen: Callable[[Ctx], list[list[str]]],
                  only: list[str] | None = None) -> Callable[[Ctx], list[list[str]]]:
    """`gen`, or for `GRAMMAR_SHARE` of the inputs one of the format's grammar productions; `only` (names of
    `ISSUE44`): every input from those of the format's productions (the format's own mutator where it has none)."""
    productions = GRAMMAR.get(fmt, [])
    share = GRAMMAR_SHARE
    if only is not None:
        productions = [ISSUE44[name] for name in only if ISSUE44[name] in productions]
        share = 1.0

    def either(ctx: Ctx) -> list[list[str]]:
        if productions and ctx.rng.random() < share:
            return ctx.rng.choice(productions)(ctx)
        return gen(ctx)

    return either


GENERATORS: dict[str, Callable[[Ctx], list[list[str]]]] = {
    "pickle": gen_pickle, "tree": gen_tree, "zip": gen_zip, "safetensors": gen_safetensors, "dcp": gen_dcp,
    "deepspeed": gen_deepspeed, "hf": gen_hf, "sentencepiece": gen_sentencepiece,
    "tokenizer_json": gen_tokenizer_json, "tokenizer_folder": gen_tokenizer_folder,
}


# --- the runner -----------------------------------------------------------------------------------

class _Hang(BaseException):
    pass


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Hang()


def _snapshot(paths: list[Path]) -> dict[str, tuple[int, int, str]]:
    """size, mtime and sha256 of every file under `paths` (links: their target text)."""
    out = {}
    for root in paths:
        items = [root] if not root.is_dir() or root.is_symlink() else [root, *root.rglob("*")]
        for p in items:
            if p.is_symlink():
                out[str(p)] = (0, 0, "link:" + os.readlink(p))
            elif p.is_file():
                st = p.stat()
                out[str(p)] = (st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            elif p.exists() and not p.is_dir():
                out[str(p)] = (0, 0, "special")
    return out


MEM_GUARD = 4 << 30  # address space one run may add: far above MEM_LIMIT, far below this machine's 24 GB


def _memory_guard() -> Callable[[], None]:
    """Cap this process's address space at its current size + MEM_GUARD for one run (RLIMIT_AS), so an
    input that makes ckptfix allocate gigabytes fails that run (a MemoryError: exit 3, a finding kept
    with its input) instead of the kernel's OOM killer ending the whole fuzzing process, as a view
    claiming 2**31 rows did once. Returns the function that lifts the cap again."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        old = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (size + MEM_GUARD, old[1]))
    except (ImportError, OSError, ValueError):
        return lambda: None
    return lambda: resource.setrlimit(resource.RLIMIT_AS, old)


def _vm_hwm() -> int:
    """Peak resident memory of this process since the last reset (bytes; 0 where /proc lacks it)."""
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> None:
    _malloc_trim()
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _malloc_trim() -> None:
    """Give the C heap's free pages back (glibc), so the next peak starts from what is really in use."""
    global _LIBC
    if _LIBC is None:
        import ctypes

        try:
            _LIBC = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC(0)


_LIBC: Any = None


def run_one(argv: list[str], watched: list[Path], work: Path) -> dict[str, Any]:
    """One CLI run in this process: exit code, output, seconds, peak memory, and what it changed."""
    from ckptfix.checkpoint import release_maps
    from ckptfix.cli import main

    before = _snapshot(watched)
    listing = sorted(os.listdir(work))
    out, err = io.StringIO(), io.StringIO()
    code: Any = None
    tracing = tracemalloc.is_tracing()
    if tracing:
        tracemalloc.reset_peak()
    py_base = tracemalloc.get_traced_memory()[0] if tracing else 0
    _reset_hwm()
    base_rss = _vm_hwm()
    guard = _memory_guard()
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGPROF, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, HANG_LIMIT)
    signal.setitimer(signal.ITIMER_PROF, TIME_LIMIT * 4)
    t, cpu = time.perf_counter(), time.process_time()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except _Hang:
        code = "hang"
    except BaseException as exc:  # noqa: BLE001 - a crash is a finding, not the end of the run
        code = f"escaped:{type(exc).__name__}: {exc}"[:300]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.setitimer(signal.ITIMER_PROF, 0)
        guard()
    seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
    release_maps()
    peak_py = tracemalloc.get_traced_memory()[1] - py_base if tracing else 0
    peak_rss = max(0, _vm_hwm() - base_rss)
    after = _snapshot(watched)
    outputs = {"out", "out.pth", "out.safetensors", "out.ckptfix.json", "out.pth.ckptfix.json",
               "out.safetensors.ckptfix.json"}
    new = sorted(set(os.listdir(work)) - set(listing) - outputs)
    return {"argv": argv, "code": code, "seconds": seconds, "cpu_seconds": cpu, "peak_py": peak_py, "peak_rss": peak_rss,
            # whole on exit 2: under --json it is one JSON error object, parsed by `problems`
            "stdout": out.getvalue() if code == 2 else out.getvalue()[-2000:], "stderr": err.getvalue()[-2000:],
            "changed": sorted(k for k in before if before[k] != after.get(k)), "stray": new}


def problems(r: dict[str, Any], input_bytes: int) -> list[str]:
    found = []
    if r["code"] not in (0, 1, 2):
        found.append(f"exit {r['code']}")
    if "Traceback" in r["stderr"] + r["stdout"] or "internal error" in r["stderr"]:
        found.append("traceback or internal error")
    if r["cpu_seconds"] > TIME_LIMIT:
        found.append(f"{r['cpu_seconds']:.1f} s of CPU ({r['seconds']:.1f} s wall)")
    if input_bytes < (1 << 20) and max(r["peak_py"], r["peak_rss"]) > MEM_LIMIT:
        found.append(f"peak {max(r['peak_py'], r['peak_rss']) >> 20} MB")
    if r["changed"]:
        found.append(f"input changed: {r['changed'][:3]}")
    if r["stray"]:
        found.append(f"stray files: {r['stray'][:3]}")
    if re.search(r"add_safe_globals\(\[[^]]*\b(_reconstructor|Popen|system|eval|memmap)\b", r["stdout"]):
        found.append("an add_safe_globals line names code")
    if r["code"] == 2 and len(r["stderr"].strip().splitlines()) != 1:
        found.append("exit 2 without exactly one error line")
    if r["code"] == 2 and not _error_stdout_ok(r):
        found.append("exit 2 with stdout other than the --json error object")
    if any(c in r["stdout"] + r["stderr"] for c in "\x1b\x07\x9b"):
        found.append("raw terminal control characters")
    return found


def _error_stdout_ok(r: dict[str, Any]) -> bool:
    """Exit 2 prints nothing on stdout, except under --json: one JSON error object (issue 18)."""
    if "--json" not in r["argv"]:
        return not r["stdout"]
    try:
        return json.loads(r["stdout"])["error"]["exit_code"] == 2
    except (ValueError, KeyError, TypeError):
        return False


def _size(paths: list[Path]) -> int:
    total = 0
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            total += sum(q.stat().st_size for q in p.rglob("*") if q.is_file() and not q.is_symlink())
        elif p.is_file():
            total += p.stat().st_size
    return total


#: What ckptfix imports inside functions, on first use: torch.distributed.checkpoint alone costs 1.7 s of CPU
#: and 100 MB resident (3.5 s under tracemalloc, 32 s on a fresh gVisor machine with no bytecode cache), once
#: per process. Charged to whichever input first reaches an in-place DCP repair, it read as a 5 s / 300 MB
#: failure of that input (the device run's seed 72000000); the same input costs 0.03 s once imported.
LAZY_IMPORTS = ("numpy", "safetensors", "sentencepiece", "tokenizers", "torch.distributed.checkpoint",
                "torch.distributed.checkpoint.filesystem", "torch.distributed.checkpoint.metadata")


def warm_up() -> None:
    """Import ckptfix's lazily imported modules before any input is measured (see LAZY_IMPORTS)."""
    import importlib

    for name in LAZY_IMPORTS:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def run(fmt: str, n: int, seed: int, seeds: dict[str, Path], scratch: Path, *, until: float | None = None,
        log: Callable[[dict], None] | None = None, only: list[str] | None = None) -> tuple[int, int, list[dict]]:
    """n inputs of one format (or until the wall clock passes `until`): (inputs, runs, failures). `only`: the
    `ISSUE44` productions to draw every input from."""
    gen = _with_grammar(fmt, GENERATORS[fmt], only)
    warm_up()
    rng = random.Random(seed)
    failures: list[dict] = []
    return _run(fmt, n, gen, rng, seeds, scratch, failures, until, log, seed)


def _run(fmt: str, n: int, gen: Callable, rng: random.Random, seeds: dict[str, Path], scratch: Path,
         failures: list[dict], until: float | None, log: Callable[[dict], None] | None,
         seed: int) -> tuple[int, int, list[dict]]:
    inputs = runs = 0
    for i in range(n):
        if until is not None and time.time() > until:
            break
        work = scratch / f"w{fmt}"
        if work.exists():
            _rmtree(work)
        work.mkdir(parents=True)
        ctx = Ctx(seeds, work, rng)
        ctx.cache = _CACHES.setdefault(fmt, {})
        try:
            cmds = gen(ctx)
        except Exception as exc:  # the mutator itself failed: not ckptfix's fault, count it apart
            failures.append({"format": fmt, "i": i, "generator_error": repr(exc)[:300]})
            continue
        inputs += 1
        watched = [p for p in work.iterdir() if not p.name.startswith("out")] + [seeds[k] for k in
                                                                                 ("pth", "sentencepiece")]
        size = _size([p for p in work.iterdir() if not p.name.startswith("out")])
        trace = (i % TRACE_EVERY == 0 or not _vm_hwm()) and not tracemalloc.is_tracing()
        if trace:
            tracemalloc.start()
        try:
            results = [run_one(argv, watched, work) for argv in cmds]
        finally:
            if trace:  # tracing slows every later allocation: never leave it on
                tracemalloc.stop()
        for r in results:
            runs += 1
            _note_worst(fmt, r, size, work, scratch)
            found = problems(r, size)
            slow = not found and r["seconds"] > TIME_LIMIT
            if found or slow:
                failure = {"format": fmt, "i": i, "seed": seed, **({"problems": found} if found else {"slow_wall": True}),
                           **r}
                failures.append(failure)
                keep = scratch / ("failures" if found else "slow") / f"{fmt}-{seed}-{i}"
                if not keep.exists():
                    shutil.copytree(work, keep, symlinks=True, ignore=_skip_special)
                if log:
                    log(failure)
    return inputs, runs, failures


_CACHES: dict[str, dict] = {}
#: Per format, the slowest run and the largest peak (RSS and Python heap) on inputs under 1 MB, with their argv.
WORST: dict[str, dict[str, Any]] = {}


def _note_worst(fmt: str, r: dict[str, Any], size: int, work: Path, scratch: Path) -> None:
    """Keep the record runs, and a copy of the input of the slowest one (under `worst/`) to time it alone."""
    worst = WORST.setdefault(fmt, {"seconds": 0.0, "cpu_seconds": 0.0, "peak_rss": 0, "peak_py": 0})
    for key in ("seconds", "cpu_seconds", "peak_rss", "peak_py"):
        if (key.endswith("seconds") or size < (1 << 20)) and r[key] > worst[key]:
            worst[key] = r[key]
            worst[key + "_argv"] = r["argv"]
            if key == "cpu_seconds" and r[key] > 1.0:
                keep = scratch / "worst" / fmt
                if keep.exists():
                    _rmtree(keep)
                shutil.copytree(work, keep, symlinks=True, ignore=_skip_special)
                (keep / "run.json").write_text(json.dumps({k: r[k] for k in ("argv", "cpu_seconds", "seconds", "peak_py")}))


def _skip_special(folder: str, names: list[str]) -> list[str]:
    import stat as st

    return [n for n in names if not (os.path.islink(os.path.join(folder, n)) or
                                     st.S_ISREG(os.lstat(os.path.join(folder, n)).st_mode) or
                                     st.S_ISDIR(os.lstat(os.path.join(folder, n)).st_mode))]


def _rmtree(path: Path) -> None:
    for p in sorted(path.rglob("*"), key=lambda q: -len(q.parts)):
        if p.is_symlink() or not p.is_dir():
            p.unlink()
        else:
            p.rmdir()
    path.rmdir()


def main(argv: list[str]) -> int:
    """FORMAT[,FORMAT...] (or `all`: every format in turn, 200 inputs each) N [SEED] [--until HH:MM UTC]
    [--only kinds,paths,many] (every input from those productions of `ISSUE44`, in the formats that have them)."""
    fmt, n = argv[0], int(argv[1])
    only = argv[argv.index("--only") + 1].split(",") if "--only" in argv else None
    seed = int(argv[2]) if len(argv) > 2 and not argv[2].startswith("--") else 0
    until = None
    if "--until" in argv:
        hh, mm = argv[argv.index("--until") + 1].split(":")
        now = time.gmtime()
        until = time.mktime(time.struct_time((now.tm_year, now.tm_mon, now.tm_mday, int(hh), int(mm), 0, 0, 0, 0))) \
            - time.timezone
        if until < time.time():  # a time of day already past: tomorrow's (23:00 --until 01:00)
            until += 86400
    formats = list(FORMATS) if fmt == "all" else fmt.split(",")
    scratch = Path(os.environ.get("FUZZ_DIR") or tempfile.mkdtemp(prefix="ckptfix-fuzz-"))
    seeds = _load_seeds(scratch / "seeds", deepspeed="deepspeed" in formats)
    logs = {f: open(scratch / f"failures-{f}.jsonl", "a") for f in formats}
    t0 = time.time()
    totals = {f: {"inputs": 0, "runs": 0, "failures": 0, "cpu_s": 0.0, "done": 0} for f in formats}
    chunk = 200
    while any(t["done"] < n for t in totals.values()) and (until is None or time.time() < until):
        for f in formats:
            t = totals[f]
            if t["done"] >= n or (until is not None and time.time() >= until):
                continue
            c0 = time.process_time()
            inputs, runs, failures = run(f, min(chunk, n - t["done"]), seed + t["done"], seeds, scratch, until=until,
                                         log=lambda x, f=f: (logs[f].write(json.dumps(x, default=str) + "\n"),
                                                             logs[f].flush()), only=only)
            t["done"] += chunk
            t["inputs"] += inputs
            t["runs"] += runs
            t["failures"] += sum(1 for x in failures if "problems" in x)
            t["cpu_s"] += time.process_time() - c0
            w = WORST.get(f, {})
            print(json.dumps({"format": f, "seed": seed, "inputs": t["inputs"], "runs": t["runs"],
                              "failures": t["failures"], "cpu_s": round(t["cpu_s"], 1),
                              "per_cpu_s": round(t["inputs"] / max(t["cpu_s"], 1e-9), 1),
                              "elapsed_s": round(time.time() - t0, 1), "worst_cpu_s": round(w.get("cpu_seconds", 0), 2),
                              "worst_wall_s": round(w.get("seconds", 0), 2),
                              "worst_rss_mb": w.get("peak_rss", 0) >> 20, "worst_py_mb": w.get("peak_py", 0) >> 20}),
                  flush=True)
    return 1 if any(t["failures"] for t in totals.values()) else 0


def _load_seeds(seed_dir: Path, deepspeed: bool) -> dict[str, Path]:
    """The seed files, made once per scratch folder (DeepSpeed's only when a format needs it)."""
    listed = seed_dir / "seeds.json"
    seeds = {k: Path(v) for k, v in json.loads(listed.read_text()).items()} if listed.exists() else \
        make_seeds(seed_dir, deepspeed=deepspeed)
    if deepspeed and "deepspeed" not in seeds:
        ds = _deepspeed_seed(seed_dir / "ds")
        if ds is not None:
            seeds["deepspeed"] = ds
    listed.write_text(json.dumps({k: str(v) for k, v in seeds.items()}))
    return seeds


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
