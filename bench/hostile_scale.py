"""CPU time of inspect / repair on the hostile inputs of issue 44 item 3, at doubling sizes: is each linear, and
within SECURITY.md's 5 s of CPU per run (the fuzzer's `TIME_LIMIT`) at the size the issue names?

    python -m bench.hostile_scale [--case safetensors,steps,dcp] [--repeats 3] [--scale 1.0] [--code DIR]

(`--code DIR`: import ckptfix from DIR, e.g. an older commit's `git archive`, to time it against this one.)

Cases (each written to a temporary folder, then run):

  safetensors  a safetensors header of N one-element tensors (75,000 / 150,000 / 300,000: 17 MB of header at
               the largest, as the issue's input), `inspect`
  steps        a torch.save file with an optimizer state of N entries, each with its own `step` tensor (AdamW
               saves a 0-d tensor; distinct values: 37,500 / 75,000 / 150,000), `inspect`
  dcp          a dcp.save folder of N parameters with an AdamW state (500 / 1,000 / 2,000), links planted on the
               names an in-place repair writes (`.metadata.ckptfix-bak` is left out: it makes repair refuse),
               `repair --in-place --keep-ids`

Each run is a fresh interpreter. Two numbers per run: `command` is the CPU time (user + system, all threads) of
`ckptfix.cli.main` itself after the modules ckptfix imports lazily are imported (what the fuzzer charges a run,
`tests/fuzz_structured.py`); `process` is the whole process's (`getrusage`), interpreter and imports included.
The minimum of `--repeats` runs is printed (the machine is shared: the minimum is the least disturbed), and the
ratio of each size's command time to the previous size's (about 2 when the sizes double and the cost is linear).
Timings stay here, never in tests: on a shared 2-core machine they are noise.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import struct
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "fixtures" / "seed001" / "tokenizer.model"
SIZES = {"safetensors": [75_000, 150_000, 300_000], "steps": [37_500, 75_000, 150_000], "dcp": [500, 1_000, 2_000]}

# Run in the child: import what ckptfix imports lazily (as the fuzzer's warm-up does), then time the command.
_CHILD = r"""
import contextlib, importlib, io, json, sys, time
for name in ("numpy", "safetensors", "torch", "torch.distributed.checkpoint", "ckptfix.cli", "ckptfix.surgery"):
    with contextlib.suppress(ImportError):
        importlib.import_module(name)
from ckptfix.cli import main
argv = json.loads(sys.argv[1])
t = time.process_time()
code = 0
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main(argv)
    except SystemExit as exc:
        code = exc.code
print(json.dumps({"cpu": time.process_time() - t, "code": code}))
"""


def write_safetensors(path: Path, n: int) -> list[str]:
    header = {f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(n)}
    text = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(4 * n))
    return ["inspect", str(path)]


def write_steps(path: Path, n: int) -> list[str]:
    import torch

    model = {"embed.weight": torch.zeros(16, 8), "head.weight": torch.zeros(8, 16)}
    optimizer = {"state": {i: {"step": torch.tensor(float(i))} for i in range(n)},
                 "param_groups": [{"lr": 1e-3, "params": list(range(n))}]}
    torch.save({"model": model, "optimizer": optimizer}, path)
    return ["inspect", str(path)]


def write_dcp(path: Path, n: int) -> list[str]:
    import torch
    import torch.distributed.checkpoint as dcp

    model = {"text_embedding.weight": torch.randn(48, 8), "text_head.weight": torch.randn(48, 8),
             **{f"layers.{i}.weight": torch.randn(4) for i in range(n - 2)}}
    state = {name: {"step": torch.tensor(3.0), "exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t)}
             for name, t in model.items()}
    optim = {"state": state, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                                               "amsgrad": False, "params": list(model)}]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model, "optim": optim}, checkpoint_id=str(path))
    outside = path.parent / f"elsewhere-{path.name}"
    outside.mkdir()
    for i, name in enumerate(["__ckptfix0_0.distcp", "..metadata.ckptfix-tmp", "ckptfix.json.ckptfix-tmp",
                              "ckptfix-restore.json.ckptfix-tmp"]):
        (outside / f"victim{i}").write_bytes(b"precious")
        os.symlink(outside / f"victim{i}", path / name)
    return ["repair", str(path), "-t", str(TOKENIZER), "--in-place", "--keep-ids"]


WRITERS = {"safetensors": write_safetensors, "steps": write_steps, "dcp": write_dcp}


def time_once(argv: list[str], code: Path = ROOT) -> tuple[float, float, int]:
    """(command CPU s, whole-process CPU s, exit code) of one fresh interpreter importing ckptfix from `code`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(argv)], capture_output=True, text=True,
                          cwd=code, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    process = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise SystemExit(f"{argv}: no result\n{proc.stderr[-2000:]}") from None
    return result["cpu"], process, result["code"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="safetensors,steps,dcp")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every size (0.1 for a quick look)")
    parser.add_argument("--code", type=Path, default=ROOT, help="the folder holding the ckptfix package to time")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckptfix-bench-") as tmp:
        for case in args.case.split(","):
            previous = None
            for n in (max(2, int(s * args.scale)) for s in SIZES[case]):
                runs = []
                for r in range(args.repeats):
                    target = Path(tmp) / f"{case}-{n}-{r}"  # a fresh input per run: in place changes its folder
                    argv = WRITERS[case](target.with_suffix(".safetensors") if case == "safetensors" else
                                         target.with_suffix(".pth") if case == "steps" else target, n)
                    runs.append(time_once(argv, args.code.resolve()))
                command, process = min(r[0] for r in runs), min(r[1] for r in runs)
                ratio = f"  x{command / previous:.2f} of the previous size" if previous else ""
                print(f"{case:<12} {n:>8,}: command {command:6.2f} s CPU, process {process:6.2f} s CPU, "
                      f"exit {sorted({r[2] for r in runs})}{ratio}", flush=True)
                previous = command


if __name__ == "__main__":
    main()
