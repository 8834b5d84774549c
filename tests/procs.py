"""Launching the tests' child processes so that none outlives its test.

Every child starts in a session (process group) of its own, and whatever the outcome (success, failure,
timeout, an exception or KeyboardInterrupt in the test) the whole group is killed in a `finally`:
DeepSpeed/torch ranks, their compiler or worker children included.

`NO_SHM_BUILD` is the line a DeepSpeed script runs before `deepspeed.init_distributed`: it replaces
`build_shm_op` in the module `deepspeed.comm.torch` (where `TorchBackend.__init__` looks it up), so
DeepSpeed never JIT-compiles its C++ shm all-reduce op. (`deepspeed.comm.torch` as an attribute is the
`torch` package itself, re-exported by `deepspeed.comm`; patching it there changes nothing.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence

NO_SHM_BUILD = ('import importlib as _il; _il.import_module("deepspeed.comm.torch").build_shm_op = lambda: None'
                '  # no C++ JIT build of the shm op\n')


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group `proc` leads (it was started with start_new_session=True), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - a zombie that will not be reaped
        pass


def kill_processes(processes) -> None:
    """SIGKILL and reap multiprocessing.Process objects still alive (torch.multiprocessing's ranks)."""
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join(timeout=10)


def run(argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None, check: bool = False,
        **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, capture_output=True, text=True, ...)`, with the child's whole group killed on
    any outcome (subprocess.run kills only the child itself on timeout, not its children). Output goes to
    temporary files, not pipes: a grandchild left holding a pipe would keep a reader waiting after the child
    ended. On timeout, subprocess.TimeoutExpired (with the output so far) is raised after the kill."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(list(argv), env=None if env is None else dict(env), stdout=out, stderr=err,
                                text=True, start_new_session=True, **kwargs)
        expired = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            expired = True
        finally:
            kill_group(proc)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if expired:
        raise subprocess.TimeoutExpired(list(argv), timeout, output=stdout, stderr=stderr)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if check:
        done.check_returncode()
    return done


def run_ranks(argv: Sequence[str], envs: Sequence[Mapping[str, str]], *, timeout: float) -> list[tuple[int, str]]:
    """One process per env in `envs`, all running `argv`; waits for all of them at most `timeout` seconds in
    total (or until one fails) and returns each rank's (returncode, stderr; a peer killed after a failure has a
    negative returncode). Output goes to temporary files, not pipes (a rank
    blocked on a full pipe would hang its peers in a collective). Every rank's group is killed on any outcome;
    on timeout, subprocess.TimeoutExpired is raised after the kill."""
    with tempfile.TemporaryDirectory(prefix="ckptfix-ranks-") as logs:
        procs: list[subprocess.Popen] = []
        files = []
        try:
            for r, env in enumerate(envs):
                out = open(os.path.join(logs, f"{r}.out"), "w")  # noqa: SIM115 - closed in the finally
                err = open(os.path.join(logs, f"{r}.err"), "w")  # noqa: SIM115
                files += [out, err]
                procs.append(subprocess.Popen(list(argv), env=dict(env), stdout=out, stderr=err,
                                              start_new_session=True))
            deadline = time.monotonic() + timeout
            # Poll: once a rank fails, its peers would wait in a collective until the deadline; stop at once.
            while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(list(argv), timeout)
                time.sleep(0.1)
        finally:
            for p in procs:
                kill_group(p)
            for f in files:
                f.close()
        results = []
        for r, p in enumerate(procs):
            with open(os.path.join(logs, f"{r}.err")) as f:
                results.append((p.returncode, f.read()))
        return results
