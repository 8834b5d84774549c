"""Repair cost on large sharded folders: does it grow with the vocab tensors, not the checkpoint?

Builds, under --root (default /tmp/h20-sharded/bench), two synthetic folders of about --gb GB each:
- a DCP folder as 8 FSDP ranks write it (`__<rank>_0.distcp`, every tensor in 8 row pieces, written by
  `dcp.save` per rank and one `.metadata` built from DCP's own types), model + AdamW state
  (exp_avg, exp_avg_sq, step) for an embedding, an untied head and N square layers;
- an HF sharded safetensors folder (`model-0000k-of-0000n.safetensors` + index, ~1 GB shards, the
  embedding in the first shard and the head in the last, as `save_pretrained` places them).
The vocab tensors (with their moments) are a few % of the bytes. For each folder it times, cold (source
pages dropped with POSIX_FADV_DONTNEED after a sync) and warm: `cp -r SRC DST && sync`, `ckptfix repair
SRC -o OUT` (default mode) and `ckptfix repair SRC --in-place` (then `ckptfix restore`), and reads the bytes
each ckptfix run wrote from its /proc/self/io. Everything it builds is deleted at the end.

    nice -n 10 python bench/sharded.py --gb 16
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import warnings

ROWS, WIDTH, GROW = 6144, 4096, 256  # vocab rows x hidden (fp32); the new tokenizer has ROWS + GROW tokens
RANKS = 8


def _layers_for(gb: float, with_moments: bool) -> int:
    per = WIDTH * WIDTH * 4 * (3 if with_moments else 1)
    vocab = 2 * ROWS * WIDTH * 4 * (3 if with_moments else 1)
    return max(1, int((gb * 1e9 - vocab) // per) + 1)


def _fill(shape: tuple[int, ...], seed: float):
    import torch

    return torch.empty(shape, dtype=torch.float32).fill_(seed)


# --- DCP folder ----------------------------------------------------------------------------------

def build_dcp(folder: str, gb: float) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    layers = _layers_for(gb, True)
    shapes = {"embed_tokens.weight": (ROWS, WIDTH), "lm_head.weight": (ROWS, WIDTH)}
    shapes.update({f"layers.{i}.weight": (WIDTH, WIDTH) for i in range(layers)})
    os.makedirs(folder)
    sdm, planner, storage = {}, {}, {}
    for rank in range(RANKS):
        state: dict = {"model": {}, "optim": {"state": {}}}
        for n, (name, shape) in enumerate(shapes.items()):
            rows = shape[0] // RANKS
            piece = (rows, shape[1])
            state["model"][name] = _fill(piece, rank + n * 1e-3)
            entry = {"exp_avg": _fill(piece, 1e-3), "exp_avg_sq": _fill(piece, 1e-6)}
            if rank == 0:
                entry["step"] = torch.tensor(100.0)
            state["optim"]["state"][name] = entry
        if rank == 0:
            state["optim"]["param_groups"] = [{"lr": 1e-4, "initial_lr": 1e-4, "betas": (0.9, 0.95),
                                               "weight_decay": 0.1, "eps": 1e-8, "params": list(shapes)}]
        scratch = os.path.join(folder, f".rank{rank}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=scratch, no_dist=True)
        with open(os.path.join(scratch, ".metadata"), "rb") as f:
            import pickle

            md = pickle.load(f)
        os.replace(os.path.join(scratch, "__0_0.distcp"), os.path.join(folder, f"__{rank}_0.distcp"))
        shutil.rmtree(scratch)
        for fqn, meta in md.state_dict_metadata.items():
            planner[fqn] = md.planner_data[fqn]
            if isinstance(meta, BytesStorageMetadata) or len(meta.size) == 0:
                sdm[fqn] = meta
                offsets = None if isinstance(meta, BytesStorageMetadata) else torch.Size([])
            else:
                full = (meta.size[0] * RANKS, meta.size[1])
                offsets = torch.Size([rank * meta.size[0], 0])
                entry = sdm.setdefault(fqn, TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                                                  torch.Size(full), []))
                entry.chunks.append(ChunkStorageMetadata(offsets, meta.size))
            for index, info in md.storage_data.items():
                if index.fqn == fqn:
                    storage[MetadataIndex(fqn, offsets, rank if offsets else None)] = _StorageInfo(
                        f"__{rank}_0.distcp", info.offset, info.length, getattr(info, "transform_descriptors", None))
        del state
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        import pickle

        pickle.dump(Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage), f)


# --- HF sharded safetensors ------------------------------------------------------------------------

def build_hf(folder: str, gb: float) -> None:
    from safetensors.torch import save_file

    layers = _layers_for(gb, False)
    names = ["model.embed_tokens.weight"] + [f"model.layers.{i}.weight" for i in range(layers)] + ["lm_head.weight"]
    per_shard = max(1, int(1e9 // (WIDTH * WIDTH * 4)))  # ~1 GB shards
    shards = [names[i:i + per_shard] for i in range(0, len(names), per_shard)]
    os.makedirs(folder)
    weight_map, total = {}, 0
    for k, group in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: _fill((ROWS, WIDTH) if "embed" in n or "lm_head" in n else (WIDTH, WIDTH), k + j * 1e-3)
                   for j, n in enumerate(group)}
        save_file(tensors, os.path.join(folder, fname), metadata={"format": "pt"})
        total += sum(t.numel() * 4 for t in tensors.values())
        weight_map.update({n: fname for n in group})
        del tensors
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "vocab_size": ROWS, "hidden_size": WIDTH,
                   "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False}, f)


def build_tokenizer(path: str, size: int) -> None:
    from tokenizers import Tokenizer, models

    vocab = {"[UNK]": 0, **{f"tok{i}": i for i in range(1, size)}}
    Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(path)


# --- measuring -------------------------------------------------------------------------------------

def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(folder) for n in ns)


def drop_cache(*folders: str) -> None:
    os.sync()
    for folder in folders:
        for root, _, names in os.walk(folder):
            for n in names:
                fd = os.open(os.path.join(root, n), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def warm(folder: str) -> None:
    for root, _, names in os.walk(folder):
        for n in names:
            with open(os.path.join(root, n), "rb") as f:
                while f.read(1 << 24):
                    pass


_RUN = """
import json, sys, time
sys.argv = ["ckptfix"] + json.loads(sys.argv[1])
from ckptfix.cli import main
t = time.perf_counter()
try:
    main(sys.argv[1:])
except SystemExit as e:
    assert not e.code, e.code
wall = time.perf_counter() - t
io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
print("BENCH", json.dumps({"wall": wall, "write_bytes": int(io["write_bytes"]), "read_bytes": int(io["read_bytes"])}))
"""


def ckptfix(*args: str) -> dict:
    """One ckptfix command in a fresh interpreter; its wall time (inside) and bytes written/read (/proc/self/io)."""
    out = subprocess.run([sys.executable, "-c", _RUN, json.dumps(list(args))], capture_output=True, text=True,
                         check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("BENCH "))
    notes = [ln.strip() for ln in out.splitlines() if "copied" in ln or "in place" in ln]
    return {**json.loads(line[6:]), "notes": notes}


def cp_r(src: str, dst: str) -> float:
    t = time.perf_counter()
    subprocess.run(["cp", "-r", src, dst], check=True)
    os.sync()
    return time.perf_counter() - t


def measure(name: str, src: str, tok: str, root: str) -> list[dict]:
    size = folder_bytes(src)
    rows = []
    for cache in ("cold", "warm"):
        dst = os.path.join(root, "cp-copy")
        (drop_cache if cache == "cold" else warm)(src)
        cp_time = cp_r(src, dst)
        shutil.rmtree(dst)
        os.sync()
        out = os.path.join(root, "fixed")
        (drop_cache if cache == "cold" else warm)(src)
        default = ckptfix("repair", src, "-t", tok, "-o", out)
        shutil.rmtree(out)
        os.sync()
        (drop_cache if cache == "cold" else warm)(src)
        inplace = ckptfix("repair", src, "-t", tok, "--in-place")
        undo = ckptfix("restore", src)
        for mode, r in (("default (-o)", default), ("--in-place", inplace)):
            rows.append({"folder": name, "cache": cache, "bytes": size, "mode": mode, "wall_s": r["wall"],
                         "cp_r_s": cp_time, "vs_cp": r["wall"] / cp_time, "written": r["write_bytes"],
                         "written_frac": r["write_bytes"] / size, "notes": r["notes"]})
        rows.append({"folder": name, "cache": cache, "mode": "restore", "wall_s": undo["wall"],
                     "written": undo["write_bytes"]})
        print(json.dumps(rows[-3:], indent=1), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=16.0)
    parser.add_argument("--root", default="/tmp/h20-sharded/bench")
    parser.add_argument("--only", choices=["dcp", "hf"], default=None)
    args = parser.parse_args()
    os.makedirs(args.root, exist_ok=False)
    try:
        tok = os.path.join(args.root, "tokenizer.json")
        build_tokenizer(tok, ROWS + GROW)
        results = []
        for name, build in (("dcp", build_dcp), ("hf", build_hf)):
            if args.only not in (None, name):
                continue
            src = os.path.join(args.root, name)
            t = time.perf_counter()
            build(src, args.gb)
            print(f"built {name}: {folder_bytes(src) / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s", flush=True)
            results += measure(name, src, tok, args.root)
            shutil.rmtree(src)
        print("RESULTS", json.dumps(results))
    finally:
        shutil.rmtree(args.root, ignore_errors=True)


if __name__ == "__main__":
    main()
