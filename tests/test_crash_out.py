"""`repair -o OUT` killed at each mutating system call it makes where OUT is written (tests/crash_points.py),
for a torch.save file, an HF Trainer `checkpoint-N/` and a DCP folder: after every kill the input is
bit-identical, OUT is absent or the clean run's OUT byte for byte, and nothing but OUT's documented
temporary (`.OUT.ckptfix-tmp-*`) is left beside it; a rerun then gives the clean run's OUT. The CI slice
tries an even spread of points; `-m long` tries every one."""

from __future__ import annotations

import shutil

import pytest
from crash_points import ckptfix, kill_points, run_killed, snapshot, spread, strace
from test_crash_in_place import dcp_folder, trainer_folder

pytestmark = [pytest.mark.transformers, pytest.mark.skipif(strace() is None, reason="strace is not installed")]

TMP = ".ckptfix-tmp-"


def torch_file(root):
    from ckpt_factory import trained_checkpoint
    from tokenizer_factory import train_bpe_tokenizer_json

    (root / "in").mkdir()
    return trained_checkpoint(root / "in" / "ckpt.pth", 48, steps=2), train_bpe_tokenizer_json(root, 64, name="n.json")


def _trainer(root):
    (root / "in").mkdir()
    folder, tok = trainer_folder(root / "in")
    return folder, tok


def _dcp(root):
    (root / "in").mkdir()
    return dcp_folder(root / "in")


BUILDERS = {"torch": torch_file, "hf-trainer": _trainer, "dcp": _dcp}


def _state(path):
    return snapshot(path) if path.is_dir() else {"": path.read_bytes()}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def case(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"crash-out-{request.param}")
    source, tok = BUILDERS[request.param](root)
    name = "fixed.pth" if source.is_file() else "fixed"
    clean = root / "clean"
    clean.mkdir()
    ckptfix("repair", str(source), "-t", str(tok), "-o", str(clean / name), "--keep-ids", check=True)
    return root, source, tok, name, _state(source), _state(clean / name)


def _kill_out(case, point, n: int) -> None:
    root, source, tok, name, original, want = case
    outdir = root / f"out-{n}"
    outdir.mkdir()
    out = outdir / name
    args = ["repair", str(source), "-t", str(tok), "-o", str(out), "--keep-ids"]
    proc = run_killed(args, point)
    assert proc.returncode != 0, f"{point}: not killed"
    assert _state(source) == original, f"{point}: the input changed"
    left = sorted(p.name for p in outdir.iterdir())
    assert all(n == name or n.startswith(f".{name}{TMP}") for n in left), f"{point}: strays {left}"
    if out.exists():
        assert _state(out) == want, f"{point}: OUT is there but not the clean run's"
        return
    rerun = ckptfix(*args)
    assert rerun.returncode == 0, f"{point}: rerun exit {rerun.returncode}: {rerun.stderr[-800:]}"
    assert _state(out) == want, f"{point}: the rerun's OUT differs from the clean run's"


_TRACED: dict = {}


@pytest.mark.slow
@pytest.mark.parametrize("most", [pytest.param(2, id="slice"), pytest.param(None, id="every", marks=pytest.mark.long)])
def test_repair_to_out_killed_at_each_point(case, most):
    root, source, tok, name, _original, _want = case
    if root not in _TRACED:
        probe = root / "probe"
        probe.mkdir()
        _TRACED[root] = kill_points(["repair", str(source), "-t", str(tok), "-o", str(probe / name), "--keep-ids"],
                                    probe, root / "out.strace")
    points = _TRACED[root]
    assert points, "the clean traced run made no call where OUT is written"
    chosen = points if most is None else spread(points, most)
    for n, point in enumerate(chosen):
        _kill_out(case, point, n)
    print(f"\nrepair -o ({source.name}): {len(chosen)} of {len(points)} kill points, input intact, OUT absent or "
          "whole, a rerun equal to the clean run")
    shutil.rmtree(root / "probe", ignore_errors=True)
