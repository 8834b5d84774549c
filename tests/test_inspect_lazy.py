"""`ckptfix inspect` reads metadata only: time and memory do not grow with the tensor bytes (unless --scan).

A ~300 MB checkpoint is written with torch.save, then inspected in a fresh interpreter that measures
wall time, peak RSS (VmHWM, which counts touched pages of the mapped file too), Python allocations
(tracemalloc) and bytes read through read() syscalls (/proc/self/io rchar), and then does the same for
--scan and for torch.load for comparison. Run with -s to see the numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
MB = 1 << 20

MEASURE = r"""
import json, sys, time, tracemalloc

def proc(field, name="status"):
    for line in open(f"/proc/self/{name}"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

def rss_peak():  # bytes
    return proc("VmHWM") * 1024

def rchar():
    return proc("rchar", "io")

import ckptfix, ckptfix.render, numpy  # warm imports, not billed to inspect
path = sys.argv[1]
out = {}
peak0, read0 = rss_peak(), rchar()
tracemalloc.start()
t = time.perf_counter()
report = ckptfix.inspect(path)
ckptfix.render.render_report(report)
out["inspect_s"] = time.perf_counter() - t
out["inspect_py_peak"] = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
out["inspect_rss"] = rss_peak() - peak0
out["inspect_read"] = rchar() - read0
out["findings"] = [f.code for f in report.findings]
out["tensors"] = report.to_json()["model"]["tensors"]
out["torch_imported"] = "torch" in sys.modules

peak_scan = rss_peak()
t = time.perf_counter()
scanned = ckptfix.inspect(path, scan=True)
out["scan_s"] = time.perf_counter() - t
out["scan_rss"] = rss_peak() - peak_scan
out["scan_findings"] = [f.code for f in scanned.findings]

import torch
peak1 = rss_peak()
t = time.perf_counter()
sd = torch.load(path)
out["torch_load_s"] = time.perf_counter() - t
out["torch_load_rss"] = rss_peak() - peak1
print(json.dumps(out))
"""


@pytest.fixture
def big_checkpoint(tmp_path):
    path = tmp_path / "big.pth"
    model = {f"layers.{i}.weight": torch.zeros(1024, 6144) for i in range(12)}  # 12 x 24 MiB = 288 MiB
    torch.save({"model": model, "epoch": 1, "step": 100}, path)
    del model
    yield path
    path.unlink(missing_ok=True)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="measures RSS through /proc (Linux)")
def test_inspect_does_not_read_tensor_bytes(big_checkpoint):
    size = big_checkpoint.stat().st_size
    assert size > 280 * MB
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(big_checkpoint)], capture_output=True, text=True,
                          cwd=REPO, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\nlazy inspect of a {size / MB:.0f} MiB torch.save file ({m['tensors']} tensors):\n"
          f"  inspect     {m['inspect_s'] * 1000:7.1f} ms, peak RSS +{m['inspect_rss'] / MB:.1f} MiB, "
          f"Python allocations peak {m['inspect_py_peak'] / MB:.2f} MiB, read() {m['inspect_read'] / 1024:.0f} KiB\n"
          f"  --scan      {m['scan_s'] * 1000:7.1f} ms, peak RSS +{m['scan_rss'] / MB:.1f} MiB (mapped pages read)\n"
          f"  torch.load  {m['torch_load_s'] * 1000:7.1f} ms, peak RSS +{m['torch_load_rss'] / MB:.1f} MiB")
    assert m["tensors"] == 12 and m["findings"] == [] and m["scan_findings"] == []
    assert not m["torch_imported"]
    assert m["inspect_rss"] < 100 * MB and m["inspect_py_peak"] < 100 * MB
    assert m["inspect_read"] < 4 * MB  # the zip directory and data.pkl, not the records
    # The controls: the RSS measure does see bytes being read (--scan maps and reads every record), and
    # torch.load materialises every byte.
    assert m["scan_rss"] > size * 0.5
    assert m["torch_load_rss"] > size * 0.9
