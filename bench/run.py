"""ckptfix performance benchmark: inspect vs torch.load, repair vs the naive script vs cp.

    python -m bench.run --sizes 0.5,2 --repeats 3 [--with-8gb] [--cache all] [--out bench/results/bench.json]

For each size it builds a real LM training checkpoint (bench/lm.py: embedding + 8 blocks + untied
head, AdamW exp_avg/exp_avg_sq/step, LambdaLR, GradScaler; the same ~400 tensors at every size)
and a tokenizer.json 3 ids larger than the vocab, then measures (median of --repeats, run round-robin):

  inspect (in-process)  ckptfix.inspect(path) in a Python process that already imported ckptfix,
                        vs torch.load(path, weights_only=True) (full read) and, for reference,
                        torch.load(..., mmap=True) in the same process (torch imported beforehand).
  inspect (process)     `ckptfix inspect PATH --json > /dev/null`: wall time of the whole process,
                        interpreter start-up and imports included.
  repair                `ckptfix repair PATH --tokenizer TOK -o OUT --init zeros` (a process),
  naive                 bench/naive_resize.py (torch.load whole file, torch.cat zero rows, torch.save),
  cp                    `cp PATH OUT`, and `cp` followed by `sync OUT` (fsync: repair fsyncs its
                        output, cp does not; both ratios are reported).
  diagnostics           the same repair with its source-sha256 thread disabled (monkeypatched; shows
                        what the hash costs), and a process that only computes that sha256.

Memory of each process is measured two ways:
  peak RSS   ru_maxrss from wait4() (the kernel's high-water mark of resident pages: anonymous
             + file-backed, so mmap'd checkpoint pages count);
  peak anon  the largest RssAnon seen by sampling /proc/PID/status every ~5 ms (heap, tensors:
             memory the process really owns; mmap'd file pages are RssFile and do not count).

Cache modes: "warm" (the checkpoint was read just before, so it is in the page cache) and, when
`echo 3 > /proc/sys/vm/drop_caches` is permitted, "cold" (sync + drop caches before each timed run;
then the same command is run once untimed on a small checkpoint, so the interpreter and libraries
are back in cache and only the big checkpoint's I/O is cold).

And "tight" (checkpoints larger than memory, where 10-100 GB checkpoints live): cold, and every
command runs in a memory cgroup limited to a quarter of the checkpoint (at least 384 MB), so the
page cache cannot hold the file and dirty pages are written back as they are made. It needs a
writable cgroup memory controller (v1 or v2); the naive script is expected to be killed there.

Also: a scaling table (inspect time at ~500/2000/8000 tensors), and a check that the repaired
checkpoint equals the naive script's output tensor by tensor.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRA_ROWS = 3


# ----------------------------------------------------------------------------- process measurement

def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("RssAnon", "RssFile", "VmRSS", "VmHWM")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0])
    except (OSError, ValueError):
        pass
    return out


def run_measured(cmd: list[str], *, stdout=subprocess.DEVNULL, env=None, interval: float = 0.005,
                 cgroup: "MemoryLimit | None" = None) -> dict:
    """Run `cmd` (inside `cgroup` if given); wall time (exact, from fork to reap), ru_maxrss, and
    sampled peak RssAnon/RssFile."""
    peaks = {"RssAnon": 0, "RssFile": 0, "VmHWM": 0}
    done = threading.Event()
    with tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=err, env=env, cwd=ROOT,
                                preexec_fn=cgroup.enter if cgroup is not None else None)

        def sample() -> None:
            while not done.is_set():
                for k, v in _status(proc.pid).items():
                    if k in peaks and v > peaks[k]:
                        peaks[k] = v
                time.sleep(interval)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        done.set()
        sampler.join()
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        stderr = err.read()
    return {"wall_s": wall, "rc": proc.returncode, "peak_rss_kb": usage.ru_maxrss,
            "peak_anon_kb": peaks["RssAnon"], "peak_file_kb": peaks["RssFile"], "stderr": stderr[-2000:]}


class MemoryLimit:
    """A memory cgroup (v1 or v2) whose limit covers page cache too: a checkpoint bigger than it behaves
    like one bigger than the machine's memory. `MemoryLimit.create()` is None where cgroups are not writable."""

    def __init__(self, path: Path, limit_file: str):
        self.path, self.limit_file = path, limit_file

    @classmethod
    def create(cls, name: str = "ckptfix-bench") -> "MemoryLimit | None":
        for root, limit_file in ((Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
                                 (Path("/sys/fs/cgroup"), "memory.max")):
            try:
                path = root / name
                path.mkdir(exist_ok=True)
                if (path / limit_file).exists() and (path / "cgroup.procs").exists():
                    return cls(path, limit_file)
                path.rmdir()
            except OSError:
                continue
        return None

    def set(self, limit_bytes: int) -> None:
        (self.path / self.limit_file).write_text(str(limit_bytes))

    def enter(self) -> None:  # in the child, between fork and exec
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


def tight_limit(size_bytes: int) -> int:
    return max(384 << 20, size_bytes // 4)


def mem_available_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    return -1


def can_drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def warm_file(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def cli_command() -> list[str]:
    """The real `ckptfix` console script next to this interpreter (not a pyenv shim), else -m."""
    script = Path(sys.executable).parent / "ckptfix"
    return [str(script)] if script.exists() else [sys.executable, "-m", "ckptfix.cli"]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ----------------------------------------------------------------------------- in-process child

def inproc_child(path: str, small: str, repeats: int, cold: bool) -> None:
    """Runs in a fresh process: times ckptfix.inspect and torch.load on `path` (prints JSON)."""
    import ckptfix
    from ckptfix.checkpoint import release_maps

    ckptfix.inspect(small)  # every lazily imported module is loaded before timing
    out: dict[str, list[float]] = {"inspect_s": [], "torch_load_s": [], "torch_load_mmap_s": []}
    for _ in range(repeats):
        if cold:  # unmap everything first: drop_caches cannot evict pages that are still mapped
            release_maps()
            gc.collect()
            drop_caches()
            ckptfix.inspect(small)
        release_maps()
        gc.collect()
        t = time.perf_counter()
        ckptfix.inspect(path)
        out["inspect_s"].append(time.perf_counter() - t)
    release_maps()
    import torch

    torch.load(small, weights_only=True)
    for key, kw in (("torch_load_s", {}), ("torch_load_mmap_s", {"mmap": True})):
        for _ in range(repeats):
            if cold:
                gc.collect()
                drop_caches()
                torch.load(small, weights_only=True, **kw)
            t = time.perf_counter()
            sd = torch.load(path, weights_only=True, **kw)
            out[key].append(time.perf_counter() - t)
            del sd
            gc.collect()
    print(json.dumps(out))


def compare_child(repaired: str, naive: str, old_rows: int) -> None:
    """Tensor-by-tensor comparison of the repair output and the naive script's output (prints JSON)."""
    import torch

    a = torch.load(repaired, weights_only=True, mmap=True)
    b = torch.load(naive, weights_only=True, mmap=True)
    stats = {"tensors": 0, "equal": 0, "resized": 0, "resized_old_rows_equal": 0, "resized_new_rows_equal": 0,
             "new_rows_differ": [], "mismatches": [], "extra_keys": sorted(set(map(str, a)) - set(map(str, b)))}

    def walk(x, y, where: str) -> None:
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            stats["tensors"] += 1
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or x.dtype != y.dtype:
                stats["mismatches"].append(f"{where}: type/dtype")
            elif x.shape == y.shape and x.shape[:1] != (old_rows + EXTRA_ROWS,):
                if torch.equal(x, y):
                    stats["equal"] += 1
                else:
                    stats["mismatches"].append(f"{where}: values")
            elif x.shape == y.shape:
                stats["resized"] += 1
                if torch.equal(x[:old_rows], y[:old_rows]):
                    stats["resized_old_rows_equal"] += 1
                else:
                    stats["mismatches"].append(f"{where}: old rows")
                if torch.equal(x[old_rows:], y[old_rows:]):
                    stats["resized_new_rows_equal"] += 1
                else:
                    stats["new_rows_differ"].append(where)
            else:
                stats["mismatches"].append(f"{where}: shape {tuple(x.shape)} vs {tuple(y.shape)}")
        elif isinstance(x, dict) and isinstance(y, dict):
            keys = set(x) | set(y)
            if where == "":
                keys.discard("ckptfix")  # the repair record exists only in ckptfix's output
            for k in keys:
                if k not in x or k not in y:
                    stats["mismatches"].append(f"{where}/{k}: missing")
                else:
                    walk(x[k], y[k], f"{where}/{k}")
        elif isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and len(x) == len(y):
            for i, (u, v) in enumerate(zip(x, y)):
                walk(u, v, f"{where}[{i}]")
        elif x != y and not (x != x and y != y):
            stats["mismatches"].append(f"{where}: {x!r:.40} != {y!r:.40}")

    walk(a, b, "")
    # exp_avg_sq's new rows: ckptfix fills them with the column mean of the old second moments (so the
    # first Adam updates of new rows are not ~lr-sized); the naive script zero-fills. Everything else,
    # including the zero-initialised new weight rows and exp_avg rows, must be identical.
    stats["ok"] = (not stats["mismatches"] and stats["resized"] > 0
                   and stats["resized_old_rows_equal"] == stats["resized"]
                   and all(w.endswith("exp_avg_sq") for w in stats["new_rows_differ"]))
    print(json.dumps(stats))


# ----------------------------------------------------------------------------- orchestration

def py(*args: str) -> list[str]:
    return [sys.executable, *args]


def generate(path: Path, size_gb: float, layers: int) -> dict:
    t = time.perf_counter()
    res = subprocess.run(py("-m", "bench.lm", str(path), str(size_gb * 1e9), str(layers)), cwd=ROOT,
                         check=True, capture_output=True, text=True)
    info = json.loads(res.stdout.strip().splitlines()[-1])
    info["generate_s"] = time.perf_counter() - t
    info["tensors"] = info["model_tensors"] * 4  # each parameter: weight, exp_avg, exp_avg_sq, step
    return info


def make_tokenizer(path: Path, size: int) -> None:
    subprocess.run(py("-c", f"from bench.lm import make_tokenizer_json; make_tokenizer_json({str(path)!r}, {size})"),
                   cwd=ROOT, check=True)


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path):
        self.args, self.work = args, work
        self.cli = cli_command()
        self.small = work / "small.pth"
        self.small_tok = work / "small_tok.json"
        self.small_out = work / "small_out.pth"

    def setup_small(self) -> None:
        subprocess.run(py("-m", "bench.lm", "--many", str(self.small), "500"), cwd=ROOT, check=True,
                       capture_output=True)
        make_tokenizer(self.small_tok, 1000 + EXTRA_ROWS)

    def _rewarm(self, cmd_for_small: list[str] | None) -> None:
        if cmd_for_small is not None:
            subprocess.run(cmd_for_small, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._rm(self.small_out)

    @staticmethod
    def _rm(*paths: Path) -> None:
        for p in paths:
            for q in (p, Path(str(p) + ".ckptfix.json")):
                if q.exists():
                    q.unlink()

    def timed_interleaved(self, cmds: dict, cold: bool, keep: dict[str, Path],
                          cgroup: MemoryLimit | None = None) -> dict[str, dict]:
        """Run every command --repeats times, round-robin (one run of each per round: the machine's
        drifting load hits all of them alike); medians and all samples per command. `keep`: name ->
        where to save that command's first output (for the equality check)."""
        runs: dict[str, list[dict]] = {name: [] for name in cmds}
        for i in range(self.args.repeats):
            for name, (cmd, small_cmd, outputs) in cmds.items():
                mode = "tight" if cgroup is not None else "cold" if cold else "warm"
                print(f"   [{mode}] round {i + 1}: {name} ...", flush=True)
                self._rm(*outputs)
                os.sync()
                if cold:
                    drop_caches()
                    self._rewarm(small_cmd)
                elif self.src is not None:
                    warm_file(str(self.src))
                r = run_measured(cmd, cgroup=cgroup)
                if cgroup is not None and r["rc"] in (-9, 137):
                    r["killed"] = True  # over the memory limit (the naive script): kept as a result
                elif r["rc"] not in (0, 1):
                    raise RuntimeError(f"{name} failed (rc {r['rc']}): {' '.join(map(str, cmd))}\n{r['stderr']}")
                runs[name].append(r)
                if name in keep and i == 0 and outputs and outputs[0].exists():
                    os.replace(outputs[0], keep[name])
                self._rm(*outputs)
        os.sync()
        return {name: {"wall_s": median([r["wall_s"] for r in rs]), "killed": any(r.get("killed") for r in rs),
                       "peak_rss_mb": max(r["peak_rss_kb"] for r in rs) / 1024,
                       "peak_anon_mb": max(r["peak_anon_kb"] for r in rs) / 1024,
                       "peak_file_mb": max(r["peak_file_kb"] for r in rs) / 1024,
                       "walls": [round(r["wall_s"], 4) for r in rs]} for name, rs in runs.items()}

    def measure_size(self, size_gb: float) -> dict:
        work = self.work
        src = self.src = work / f"lm_{size_gb:g}gb.pth"
        tok = work / f"tok_{size_gb:g}gb.json"
        out_repair, out_naive, out_cp = work / "repaired.pth", work / "naive.pth", work / "copy.pth"
        keep_repair, keep_naive = work / "repaired.keep.pth", work / "naive.keep.pth"
        print(f"\n== {size_gb:g} GB: generating ...", flush=True)
        info = generate(src, size_gb, self.args.layers)
        make_tokenizer(tok, info["vocab"] + EXTRA_ROWS)
        size = info["bytes"]
        print(f"   {size / 1e9:.3f} GB, vocab {info['vocab']}, dim {info['dim']}, {info['layers']} layers "
              f"({info['generate_s']:.0f} s)", flush=True)
        result = {"size_gb": size_gb, "bytes": size, "config": info, "modes": {},
                  "mem_available_mb": mem_available_mb(), "loadavg_before": os.getloadavg()}
        if result["mem_available_mb"] * 2**20 < 1.5 * size + 2**30:
            print(f"   WARNING: only {result['mem_available_mb']} MB available: torch.load/naive need ~{size / 2**20:.0f} MB "
                  "(other processes are using memory; the warm cache will not hold the file)", flush=True)
        target = info["vocab"] + EXTRA_ROWS
        cmds = {
            "inspect_cli": (self.cli + ["inspect", str(src), "--json"],
                            self.cli + ["inspect", str(self.small), "--json"], []),
            "repair": (self.cli + ["repair", str(src), "--tokenizer", str(tok), "-o", str(out_repair), "--init", "zeros"],
                       self.cli + ["repair", str(self.small), "--tokenizer", str(self.small_tok), "-o",
                                   str(self.small_out), "--init", "zeros"], [out_repair]),
            "repair_mean": (self.cli + ["repair", str(src), "--tokenizer", str(tok), "-o", str(out_repair)],
                            self.cli + ["repair", str(self.small), "--tokenizer", str(self.small_tok), "-o",
                                        str(self.small_out)], [out_repair]),
            # diagnostics: the same repair with the source-sha256 thread disabled, and the sha256 alone
            "repair_nohash": (py("-c", _NO_HASH, "repair", str(src), "--tokenizer", str(tok), "-o", str(out_repair),
                                 "--init", "zeros"),
                              py("-c", _NO_HASH, "repair", str(self.small), "--tokenizer", str(self.small_tok), "-o",
                                 str(self.small_out), "--init", "zeros"), [out_repair]),
            "sha256": (py("-c", "import sys; from ckptfix.io import sha256_file; sha256_file(sys.argv[1])", str(src)),
                       None, []),
            "naive": (py("-m", "bench.naive_resize", str(src), str(out_naive), str(target)),
                      py("-m", "bench.naive_resize", str(self.small), str(self.small_out), "1003"), [out_naive]),
            "cp": (["cp", str(src), str(out_cp)], None, [out_cp]),
            "cp_fsync": (["sh", "-c", f"cp '{src}' '{out_cp}' && sync '{out_cp}'"], None, [out_cp]),
        }
        for mode in self.modes:
            cold = mode == "cold"
            if mode == "tight":  # no in-process torch.load here: it cannot fit; the commands alone
                self.cgroup.set(tight_limit(size))
                result["tight_limit_mb"] = tight_limit(size) >> 20
                print(f"   [tight] memory limit {tight_limit(size) >> 20} MB", flush=True)
                result["modes"][mode] = self.timed_interleaved(cmds, True, {}, self.cgroup)
                continue
            print(f"   [{mode}] in-process inspect / torch.load ...", flush=True)
            if not cold:
                warm_file(str(src))
            res = subprocess.run(py("-m", "bench.run", "--_inproc", str(src), str(self.small),
                                    str(self.args.repeats), "1" if cold else "0"),
                                 cwd=ROOT, check=True, capture_output=True, text=True)
            inproc = json.loads(res.stdout.strip().splitlines()[-1])
            m = {key: median(v) for key, v in inproc.items()}
            m["samples"] = inproc
            keep = {"repair": keep_repair, "naive": keep_naive} if mode == self.modes[0] else {}
            m.update(self.timed_interleaved(cmds, cold, keep))
            result["modes"][mode] = m
        if keep_repair.exists() and keep_naive.exists():  # not with --cache tight alone: naive cannot run there
            print("   comparing repair output with the naive script's ...", flush=True)
            res = subprocess.run(py("-m", "bench.run", "--_compare", str(keep_repair), str(keep_naive),
                                    str(info["vocab"])), cwd=ROOT, check=True, capture_output=True, text=True)
            result["equality"] = json.loads(res.stdout.strip().splitlines()[-1])
            print(f"   equality: {'OK' if result['equality']['ok'] else 'MISMATCH'} {result['equality']}", flush=True)
        result["loadavg_after"] = os.getloadavg()
        if not self.args.keep:
            self._rm(src, tok, keep_repair, keep_naive)
        os.sync()
        return result

    def scaling(self) -> list[dict]:
        rows = []
        for n in self.args.scaling:
            path = self.work / f"many_{n}.pth"
            subprocess.run(py("-m", "bench.lm", "--many", str(path), str(n)), cwd=ROOT, check=True, capture_output=True)
            warm_file(str(path))
            res = subprocess.run(py("-c", _SCALING_CHILD, str(path), str(self.args.repeats)), cwd=ROOT, check=True,
                                 capture_output=True, text=True)
            t = json.loads(res.stdout.strip().splitlines()[-1])
            cli = self.timed_simple(self.cli + ["inspect", str(path), "--json"])
            rows.append({"tensors": t["tensors"], "bytes": path.stat().st_size, "inspect_s": t["inspect_s"],
                         "per_tensor_us": t["inspect_s"] / t["tensors"] * 1e6, "inspect_cli_s": cli})
            path.unlink()
        return rows

    def timed_simple(self, cmd: list[str]) -> float:
        return median([run_measured(cmd)["wall_s"] for _ in range(self.args.repeats)])


_NO_HASH = """
import sys
import ckptfix.io
ckptfix.io.BackgroundHash._run = lambda self: None  # diagnostic only: the record gets source_sha256 null
import ckptfix.cli
ckptfix.cli.main(sys.argv[1:])
"""

_SCALING_CHILD = """
import json, sys, time, statistics
import ckptfix
from ckptfix.checkpoint import release_maps
path, repeats = sys.argv[1], int(sys.argv[2])
r = ckptfix.inspect(path)
n = r.to_json()["model"]["tensors"] + sum(len(ps.tensors) + (ps.step is not None) for ps in r.ckpt.optimizer.state.values())
ts = []
for _ in range(repeats):
    release_maps(); t = time.perf_counter(); ckptfix.inspect(path); ts.append(time.perf_counter() - t)
print(json.dumps({"tensors": n, "inspect_s": statistics.median(ts)}))
"""


def environment(modes: list[str]) -> dict:
    def first_line(cmd: str) -> str:
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip().splitlines()[0]
        except (IndexError, OSError):
            return "?"

    mem = first_line("grep MemTotal /proc/meminfo")
    t = time.perf_counter()
    subprocess.run(py("-c", "import torch"), check=True)
    torch_import = time.perf_counter() - t
    t = time.perf_counter()
    subprocess.run(py("-c", "pass"), check=True)
    python_start = time.perf_counter() - t
    return {"python": platform.python_version(), "torch": first_line(f"{sys.executable} -c 'import torch; print(torch.__version__)'"),
            "cpu": first_line("grep -m1 'model name' /proc/cpuinfo"), "cores": os.cpu_count(), "mem": mem,
            "loadavg_start": os.getloadavg(), "cache_modes": modes, "python_start_s": python_start,
            "torch_import_process_s": torch_import, "cli": cli_command()}


# ----------------------------------------------------------------------------- report

TARGETS = {"inspect_speedup_min": 50, "inspect_cli_max_s": 1.0, "repair_over_cp_max": 1.5, "repair_anon_frac_max": 0.25}


def tables(results: dict) -> str:
    lines = []
    for mode in results["env"]["cache_modes"]:
        rows = [(r, r["modes"][mode]) for r in results["sizes"] if mode in r["modes"]]
        if mode == "tight":
            limits = ", ".join(f"{r['bytes'] / 1e9:.2f} GB: {r.get('tight_limit_mb')} MB" for r, _ in rows)
            lines.append(f"\n[tight: cold, in a memory cgroup of a quarter of the checkpoint ({limits})]")
            lines.extend(f"{r['bytes'] / 1e9:8.2f} GB  inspect CLI {m['inspect_cli']['wall_s']:.2f}s" for r, m in rows)
        lines.extend(_inspect_table(mode, rows, results["repeats"]) if mode != "tight" else [])
        lines.append(f"\n[{mode} cache] repair wall time  (processes; repair = --init zeros, like the naive script; "
                     f"repair(mean) = the default init; naive 'killed' = over the memory limit)")
        lines.extend(_repair_tables(mode, rows))
    lines.append("\n[scaling: inspect vs number of tensors, warm cache]")
    lines.append(f"{'tensors':>8} {'file MB':>8} {'in-proc':>9} {'per tensor':>11} {'CLI':>7}")
    for s in results["scaling"]:
        lines.append(f"{s['tensors']:8d} {s['bytes'] / 1e6:8.1f} {s['inspect_s'] * 1e3:7.1f}ms "
                     f"{s['per_tensor_us']:9.1f}us {s['inspect_cli_s']:6.2f}s")
    lines.append("\n[repair output vs naive script output, tensor by tensor]")
    for r in (r for r in results["sizes"] if "equality" in r):
        e = r["equality"]
        differ = sorted({w.rsplit("/", 1)[-1] for w in e["new_rows_differ"]})
        lines.append(f"{r['bytes'] / 1e9:6.2f} GB: {'OK' if e['ok'] else 'MISMATCH'}  {e['tensors']} tensors: "
                     f"{e['equal']} identical, {e['resized']} resized with identical old rows and shapes, "
                     f"{e['resized_new_rows_equal']} of them with identical new rows too"
                     + (f" (new rows differ by design in {', '.join(differ)}: ckptfix fills the column mean, "
                        "the naive script zeros)" if differ else "")
                     + (f"; mismatches: {e['mismatches'][:5]}" if e["mismatches"] else ""))
    lines.append("\n[targets]")
    lines.extend(check_targets(results))
    return "\n".join(lines)


def _inspect_table(mode: str, rows: list, repeats: int) -> list[str]:
    lines = [f"\n[{mode} cache] inspect  (medians of {repeats} runs)",
             f"{'size GB':>8} {'tensors':>7} {'inspect':>9} {'torch.load':>10} {'speedup':>8} "
             f"{'load(mmap)':>10} {'inspect CLI':>11}",
             f"{'':>8} {'':>7} {'in-proc':>9} {'in-proc':>10} {'':>8} {'in-proc':>10} {'process':>11}"]
    for r, m in rows:
        lines.append(f"{r['bytes'] / 1e9:8.2f} {r['config'].get('tensors', 0):7d} {m['inspect_s'] * 1e3:7.1f}ms "
                     f"{m['torch_load_s']:9.2f}s {m['torch_load_s'] / m['inspect_s']:7.0f}x "
                     f"{m['torch_load_mmap_s'] * 1e3:8.0f}ms {m['inspect_cli']['wall_s']:10.2f}s")
    return lines


def _repair_tables(mode: str, rows: list) -> list[str]:
    lines = [f"{'size GB':>8} {'repair':>7} {'repair':>7} {'naive':>7} {'cp':>6} {'cp+sync':>7} "
             f"{'repair/cp':>9} {'repair/':>8} {'mean/cp':>7} {'naive/cp':>8} {'| no-hash':>9} {'no-hash/':>9} "
             f"{'sha256':>7}",
             f"{'':>8} {'':>7} {'(mean)':>7} {'':>7} {'':>6} {'':>7} {'':>9} {'(cp+sync)':>8} {'':>7} {'':>8} "
             f"{'| repair':>9} {'(cp+sync)':>9} {'alone':>7}"]
    for r, m in rows:
        cp, cps, naive = m["cp"]["wall_s"], m["cp_fsync"]["wall_s"], m["naive"]
        naive_s, naive_x = ("killed", "-") if naive.get("killed") else (f"{naive['wall_s']:6.2f}s",
                                                                       f"{naive['wall_s'] / cp:7.2f}x")
        lines.append(f"{r['bytes'] / 1e9:8.2f} {m['repair']['wall_s']:6.2f}s {m['repair_mean']['wall_s']:6.2f}s "
                     f"{naive_s:>7} {cp:5.2f}s {cps:6.2f}s {m['repair']['wall_s'] / cp:8.2f}x "
                     f"{m['repair']['wall_s'] / cps:8.2f}x {m['repair_mean']['wall_s'] / cp:6.2f}x "
                     f"{naive_x:>8} | {m['repair_nohash']['wall_s']:6.2f}s "
                     f"{m['repair_nohash']['wall_s'] / cps:8.2f}x {m['sha256']['wall_s']:6.2f}s")
    lines += [f"\n[{mode} cache] repair memory  (peak anon = max sampled RssAnon; peak RSS = ru_maxrss, "
              f"includes mmap'd file pages)",
              f"{'size GB':>8} {'repair anon':>16} {'repair(mean) anon':>18} {'naive anon':>17} "
              f"{'repair RSS':>10} {'mean RSS':>9} {'naive RSS':>9}"]
    for r, m in rows:
        def anon(k: str, r: dict = r, m: dict = m) -> str:
            mb = m[k]["peak_anon_mb"]
            return f"{mb:6.0f}MB {mb * 2**20 / r['bytes']:6.1%}" + (" killed" if m[k].get("killed") else "")
        lines.append(f"{r['bytes'] / 1e9:8.2f} {anon('repair'):>16} {anon('repair_mean'):>18} {anon('naive'):>17} "
                     f"{m['repair']['peak_rss_mb']:8.0f}MB {m['repair_mean']['peak_rss_mb']:7.0f}MB "
                     f"{m['naive']['peak_rss_mb']:7.0f}MB")
    return lines


def check_targets(results: dict) -> list[str]:
    out = []
    for mode in results["env"]["cache_modes"]:
        rows = [(r, r["modes"][mode]) for r in results["sizes"] if mode in r["modes"]]
        for r, m in rows:
            gb = r["bytes"] / 1e9
            speed = m["torch_load_s"] / m["inspect_s"] if "inspect_s" in m else None
            anon = m["repair"]["peak_anon_mb"] * 2**20 / r["bytes"]
            anon_mean = m["repair_mean"]["peak_anon_mb"] * 2**20 / r["bytes"]
            rc, rcs = m["repair"]["wall_s"] / m["cp"]["wall_s"], m["repair"]["wall_s"] / m["cp_fsync"]["wall_s"]
            speedup = f"inspect speedup {speed:6.0f}x (>= 50: {'PASS' if speed >= 50 else 'MISS'})" if speed else "(no in-process inspect)"
            out.append(f"{mode:5} {gb:5.2f} GB  {speedup}  "
                       f"inspect CLI {m['inspect_cli']['wall_s']:.2f}s (< 1 s: {'PASS' if m['inspect_cli']['wall_s'] < 1 else 'MISS'})  "
                       f"repair/cp {rc:.2f}x, repair/(cp+fsync) {rcs:.2f}x (<= 1.5: {'PASS' if rc <= 1.5 else 'MISS'}/"
                       f"{'PASS' if rcs <= 1.5 else 'MISS'})  repair anon {anon:.1%} (<= 25%: {'PASS' if anon <= 0.25 else 'MISS'}; "
                       f"default init {anon_mean:.1%}: {'PASS' if anon_mean <= 0.25 else 'MISS'})")
        if len(rows) > 1 and mode != "tight":
            ts = [m["inspect_s"] for _, m in rows]
            out.append(f"{mode:4} inspect flat across sizes: {min(ts) * 1e3:.1f}..{max(ts) * 1e3:.1f} ms "
                       f"(max/min {max(ts) / min(ts):.2f})")
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--_inproc":
        return inproc_child(argv[1], argv[2], int(argv[3]), argv[4] == "1")
    if argv and argv[0] == "--_compare":
        return compare_child(argv[1], argv[2], int(argv[3]))
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size (ignored if --sizes is given)")
    ap.add_argument("--sizes", type=lambda s: [float(x) for x in s.split(",")], help="comma-separated sizes in GB")
    ap.add_argument("--with-8gb", action="store_true", help="also run an 8 GB checkpoint")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--scaling", type=lambda s: [int(x) for x in s.split(",")], default=[500, 2000, 8000])
    ap.add_argument("--cache", choices=["both", "all", "warm", "cold", "tight"], default="both",
                    help="both = warm + cold; all = warm + cold + tight (larger than memory, needs cgroups)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench.json"))
    ap.add_argument("--workdir", default="/tmp/ckptfix-bench",
                    help="where the checkpoints are written (needs ~3.2x the largest size free)")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    args = ap.parse_args(argv)
    sizes = args.sizes or [args.size_gb]
    if args.with_8gb and 8.0 not in sizes:
        sizes.append(8.0)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    need = max(sizes) * 3.2e9
    free = shutil.disk_usage(work).free
    if free < need:
        sys.exit(f"need ~{need / 1e9:.0f} GB free in {work}, have {free / 1e9:.0f} GB")
    droppable = args.cache != "warm" and can_drop_caches()
    cgroup = MemoryLimit.create() if droppable and args.cache in ("all", "tight") else None
    modes = ["warm"] + (["cold"] if droppable else []) + (["tight"] if cgroup is not None else [])
    if args.cache in ("cold", "tight"):
        modes = [m for m in modes if m == args.cache] or modes
    env = environment(modes)
    print(f"cache modes: {modes}; CLI: {' '.join(env['cli'])}; python start {env['python_start_s']:.2f}s, "
          f"`import torch` process {env['torch_import_process_s']:.2f}s; load {env['loadavg_start']}", flush=True)
    bench = Bench(args, work)
    bench.modes, bench.src, bench.cgroup = modes, None, cgroup
    bench.setup_small()
    results = {"repeats": args.repeats, "env": env, "targets": TARGETS, "sizes": [], "notes": [
        "peak_rss_mb: ru_maxrss (anon + file-backed resident pages, so mmap'd checkpoint pages count)",
        "peak_anon_mb: max sampled RssAnon (/proc/PID/status every ~5 ms): memory the process owns",
        "cold: sync + drop_caches before each timed run, then the same command untimed on a small checkpoint "
        "so only the big checkpoint's I/O is cold",
        "cp does not fsync; ckptfix repair fsyncs its output (atomic write); cp_fsync = cp + sync FILE",
        "repair_nohash (diagnostic): ckptfix repair with the source-sha256 thread disabled by a monkeypatch; "
        "sha256: a process hashing the file with ckptfix.io.sha256_file, alone",
    ]}
    try:
        for size in sizes:
            results["sizes"].append(bench.measure_size(size))
        bench.src = None
        print("\n== scaling ...", flush=True)
        results["scaling"] = bench.scaling()
    finally:
        if cgroup is not None:
            cgroup.remove()
        if not args.keep:  # only what the bench wrote: checkpoints, their outputs, tokenizers
            for p in [*work.glob("*.pth"), *work.glob("*.ckptfix.json"), *work.glob("*tok*.json")]:
                p.unlink(missing_ok=True)
    results["env"]["loadavg_end"] = os.getloadavg()
    results["target_lines"] = check_targets(results)
    text = tables(results)
    results["table"] = text
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    print(text)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
