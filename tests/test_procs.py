"""tests/procs.py: a child's whole process group (its own children included) is killed on every outcome."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from procs import run, run_ranks

# The child starts a grandchild that would sleep for a minute, prints its pid, then waits for it.
_TREE = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
         "print(p.pid, flush=True); sys.stderr.write(str(p.pid)); sys.stderr.flush(); {tail}")


def _gone(pid: int) -> bool:
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":  # a zombie of a reaped parent's group: dead
                return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_run_kills_the_grandchild_on_success_and_on_timeout():
    done = run([sys.executable, "-c", _TREE.format(tail="")], timeout=30)
    assert done.returncode == 0 and _gone(int(done.stdout))
    with pytest.raises(subprocess.TimeoutExpired) as err:
        run([sys.executable, "-c", _TREE.format(tail="p.wait()")], timeout=2)
    assert _gone(int(err.value.output))


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_run_ranks_kills_every_rank_on_a_failure_and_on_timeout():
    # rank 0 fails at once; rank 1 would wait for a minute (a peer blocked in a collective)
    argv = [sys.executable, "-c", "import os, time; r = os.environ['RANK']; "
            "print(os.getpid(), flush=True); time.sleep(0 if r == '0' else 60); raise SystemExit(int(r == '0'))"]
    t = time.monotonic()
    ranks = run_ranks(argv, [{**os.environ, "RANK": str(r)} for r in range(2)], timeout=120)
    assert [rc for rc, _ in ranks] == [1, -9] and time.monotonic() - t < 60  # not waited out
    tree = [sys.executable, "-c", _TREE.format(tail="p.wait()")]
    with pytest.raises(subprocess.TimeoutExpired):
        run_ranks(tree, [dict(os.environ)] * 2, timeout=2)
