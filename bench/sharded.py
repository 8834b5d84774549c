"""Repair cost on large sharded folders: does it grow with the vocab tensors, not the checkpoint?

Builds, under --root (default /tmp/ckptfix-bench-sharded), two synthetic folders of about --gb GB each:
- a DCP folder as 8 FSDP ranks write it (`__<rank>_0.distcp`, every tensor in 8 row pieces, written by
  `dcp.save` per rank and one `.metadata` built from DCP's own types), model + AdamW state
  (exp_avg, exp_avg_sq, step) for an embedding, an untied head and N square layers;
- an HF sharded safetensors folder (`model-0000k-of-0000n.safetensors` + index, ~1 GB shards, the
  embedding in the first shard and the head in the last, as `save_pretrained` places them).
The vocab tensors (with their moments) are a few % of the bytes. For each folder, in --rounds rounds of
(cold, warm), it times from the same cache state: `cp -r SRC DST` + sync, `ckptfix repair SRC -o OUT`
(default mode) + sync and `ckptfix repair SRC --in-place` + sync (then `ckptfix restore`), each ckptfix
run a fresh interpreter timed from outside, and reads the bytes each run wrote from its /proc/self/io.
Cold: the page cache dropped (/proc/sys/vm/drop_caches, as root) after a sync, else (or with `--cold
source`: torch's libraries stay cached) the source's pages dropped with POSIX_FADV_DONTNEED; warm: the source read once just before. It prints each round, the
load average, and a markdown table of medians (the README's). Everything it builds is deleted at the end.

    python bench/sharded.py --gb 16 --rounds 3
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
            # torch.optim.AdamW's own group options: ckptfix tells the optimizer's kind by them
            state["optim"]["param_groups"] = [{"lr": 1e-4, "initial_lr": 1e-4, "betas": (0.9, 0.95),
                                               "weight_decay": 0.1, "eps": 1e-8, "amsgrad": False,
                                               "maximize": False, "foreach": None, "capturable": False,
                                               "differentiable": False, "fused": None, "decoupled_weight_decay": True,
                                               "params": list(shapes)}]
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


#: "all": the whole page cache dropped, torch's libraries too (a machine that has not run torch since boot);
#: "source": only the checkpoint's pages dropped (a machine that ran torch before: the usual case).
COLD = "all"


def drop_cache(*folders: str) -> str:
    """Cold cache: the whole page cache dropped (`/proc/sys/vm/drop_caches`, needs root) after a sync,
    else (or with `--cold source`) the folders' pages dropped with POSIX_FADV_DONTNEED. Returns which."""
    os.sync()
    if COLD == "all":
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "drop_caches"
        except OSError:
            pass
    for folder in folders:
        for root, _, names in os.walk(folder):
            for n in names:
                fd = os.open(os.path.join(root, n), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    return "fadvise"


def warm(folder: str) -> str:
    for root, _, names in os.walk(folder):
        for n in names:
            with open(os.path.join(root, n), "rb") as f:
                while f.read(1 << 24):
                    pass
    return "read"


_RUN = """
import json, sys
sys.argv = ["ckptfix"] + json.loads(sys.argv[1])
from ckptfix.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    assert not e.code, e.code
io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
print("BENCH", json.dumps({"write_bytes": int(io["write_bytes"]), "read_bytes": int(io["read_bytes"])}))
"""


def ckptfix(*args: str) -> dict:
    """One ckptfix command in a fresh interpreter, then `sync` (as for cp -r): its wall time, measured
    outside (interpreter start and imports included), and the bytes it wrote (/proc/self/io)."""
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _RUN, json.dumps(list(args))], capture_output=True, text=True,
                         check=True).stdout
    os.sync()
    wall = time.perf_counter() - t
    line = next(ln for ln in out.splitlines() if ln.startswith("BENCH "))
    notes = [ln.strip() for ln in out.splitlines() if "copied" in ln or "in place" in ln]
    return {**json.loads(line[6:]), "wall": wall, "notes": notes}


def cp_r(src: str, dst: str) -> float:
    t = time.perf_counter()
    subprocess.run(["cp", "-r", src, dst], check=True)
    os.sync()
    return time.perf_counter() - t


def one_round(name: str, src: str, tok: str, root: str, cache: str) -> list[dict]:
    """cp -r, the default mode and --in-place (then restore), each from the same cache state."""
    size, rows = folder_bytes(src), []
    prepare = drop_cache if cache == "cold" else warm
    dst = os.path.join(root, "cp-copy")
    how = prepare(src)
    cp_time = cp_r(src, dst)
    shutil.rmtree(dst)
    out = os.path.join(root, "fixed")
    prepare(src)
    default = ckptfix("repair", src, "-t", tok, "-o", out)
    shutil.rmtree(out)
    prepare(src)
    inplace = ckptfix("repair", src, "-t", tok, "--in-place")
    undo = ckptfix("restore", src)
    for mode, r in (("cp -r", {"wall": cp_time, "write_bytes": size, "notes": []}), ("default (-o)", default),
                    ("--in-place", inplace), ("restore", undo)):
        rows.append({"folder": name, "cache": cache, "how": how, "bytes": size, "mode": mode, "wall_s": r["wall"],
                     "cp_r_s": cp_time, "vs_cp": r["wall"] / cp_time, "written": r["write_bytes"],
                     "written_frac": r["write_bytes"] / size, "notes": r["notes"]})
    return rows


def table(results: list[dict]) -> str:
    """Markdown: per folder, cache and mode, the median over rounds (min-max) of wall time and of the
    ratio to the same round's cp -r, and the share of the folder's bytes written."""
    from statistics import median

    lines = ["| folder | cache | mode | wall s, median (min-max) | vs cp -r, median (min-max) | bytes written |",
             "|---|---|---|---|---|---|"]
    keys = sorted({(r["folder"], r["cache"], r["mode"]) for r in results},
                  key=lambda k: (k[0], k[1], ["cp -r", "default (-o)", "--in-place", "restore"].index(k[2])))
    for folder, cache, mode in keys:
        rs = [r for r in results if (r["folder"], r["cache"], r["mode"]) == (folder, cache, mode)]
        walls, ratios = [r["wall_s"] for r in rs], [r["vs_cp"] for r in rs]
        frac = median(r["written_frac"] for r in rs)
        lines.append(f"| {folder} ({rs[0]['bytes'] / 1e9:.1f} GB) | {cache} | {mode} | {median(walls):.1f} "
                     f"({min(walls):.1f}-{max(walls):.1f}) | {median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) "
                     f"| {100 * frac:.1f}% |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=16.0)
    parser.add_argument("--root", default="/tmp/ckptfix-bench-sharded")
    parser.add_argument("--only", choices=["dcp", "hf"], default=None)
    parser.add_argument("--cold", choices=["all", "source"], default="all",
                        help="cold means the whole page cache dropped (all) or the checkpoint's pages only (source)")
    parser.add_argument("--rounds", type=int, default=3, help="round-robin repeats (cold, warm, cold, ...)")
    args = parser.parse_args()
    global COLD
    COLD = args.cold
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
            for k in range(args.rounds):
                for cache in ("cold", "warm"):
                    load = os.getloadavg()[0]
                    rows = one_round(name, src, tok, args.root, cache)
                    for r in rows:
                        r["load"] = load
                    results += rows
                    print(f"round {k + 1} {name} {cache} (load {load:.1f}): " + ", ".join(
                        f"{r['mode']} {r['wall_s']:.1f} s ({r['vs_cp']:.2f}x, {100 * r['written_frac']:.1f}%)"
                        for r in rows), flush=True)
            print(rows[1]["notes"], rows[2]["notes"], flush=True)
            shutil.rmtree(src)
        loads = [r["load"] for r in results]
        print(f"\nload average (1 min) at the start of each round: {min(loads):.1f}-{max(loads):.1f} "
              f"on {os.cpu_count()} CPUs")
        print(table(results))
        print("RESULTS", json.dumps(results))
    finally:
        shutil.rmtree(args.root, ignore_errors=True)


if __name__ == "__main__":
    main()
