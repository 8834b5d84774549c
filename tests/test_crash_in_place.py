"""`repair --in-place` and `restore` killed at their mutating system calls (tests/crash_points.py): after
every kill the folder restores to bit-identical, and running the repair again gives the clean run's result.
The CI slice tries an even spread of points; `-m long` tries every one."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from crash_points import KillPoint, ckptfix, kill_points, run_killed, snapshot, spread, strace
from tokenizer_factory import train_bpe_tokenizer_json

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.transformers, pytest.mark.skipif(strace() is None, reason="strace is not installed")]

OLD = 64
OURS = ("ckptfix.json", "ckptfix-restore.json")  # written by each run: times and notes differ


def trainer_folder(root):
    """A Trainer `checkpoint-N/`: sharded weights, AdamW after a real step, its schedule, RNG, state and
    the tokenizer's files."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=OLD, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = transformers.get_linear_schedule_with_warmup(opt, 1, 10)
    model(torch.randint(0, OLD, (2, 8)), labels=torch.randint(0, OLD, (2, 8))).loss.backward()
    opt.step()
    sched.step()
    folder = root / "checkpoint-1"
    model.save_pretrained(folder, max_shard_size="8KB")
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    torch.save(sched.state_dict(), folder / "scheduler.pt")
    torch.save({"python": None, "cpu": torch.get_rng_state()}, folder / "rng_state.pth")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 1, "log_history": []}))
    old_tok = train_bpe_tokenizer_json(root, OLD, name="old.json")
    transformers.PreTrainedTokenizerFast(tokenizer_file=str(old_tok), unk_token="[UNK]",
                                         pad_token="[PAD]").save_pretrained(folder)
    return folder, train_bpe_tokenizer_json(root, 80, name="new.json")


def dcp_folder(root):
    """A DCP folder as `dcp.save(get_state_dict(...))` writes it after real AdamW steps."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from ckpt_factory import new_run, train
    from torch.distributed.checkpoint.state_dict import get_state_dict

    run = train(new_run(48), 3)
    msd, osd = get_state_dict(run.model, run.optimizer)
    folder = root / "step3"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd, "sched": run.scheduler.state_dict(), "step": run.step},
                 checkpoint_id=str(folder))
    return folder, train_bpe_tokenizer_json(root, 64, name="new.json")


BUILDERS = {"hf-trainer": trainer_folder, "dcp": dcp_folder}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def case(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"crash-{request.param}")
    folder, tok = BUILDERS[request.param](root)
    original = snapshot(folder)
    repaired = root / "repaired"
    shutil.copytree(folder, repaired)
    ckptfix("repair", str(repaired), "-t", str(tok), "--in-place", "--keep-ids", check=True)
    return root, folder, tok, original, repaired


def without_ours(snap: dict[str, bytes]) -> dict[str, bytes]:
    return {k: v for k, v in snap.items() if k not in OURS}


def test_the_plain_in_place_repair_of_a_trainer_folder_restores_bit_identical(case):
    root, folder, tok, original, repaired = case
    if not (folder / "optimizer.pt").exists():
        pytest.skip("the Trainer folder's case")
    done = root / "plain"
    shutil.copytree(repaired, done)
    assert snapshot(done) != original
    assert not any(".ckptfix-scratch" in name for name in snapshot(done))
    restored = ckptfix("restore", str(done), check=True)
    assert "restored tokenizer.json" in restored.stdout, restored.stdout
    assert snapshot(done) == original  # the tokenizer files back, never removed as "added"
    loaded = transformers.LlamaForCausalLM.from_pretrained(repaired)
    assert loaded.get_input_embeddings().weight.shape[0] >= 80
    saved = torch.load(repaired / "optimizer.pt", weights_only=True)
    rows = {tuple(s["exp_avg"].shape) for s in saved["state"].values()}
    assert any(r[0] >= 80 for r in rows)  # the moments grew with the table


def _kill_repair(case, point: KillPoint, n: int) -> None:
    root, folder, tok, original, repaired = case
    args = lambda f: [ "repair", str(f), "-t", str(tok), "--in-place", "--keep-ids"]  # noqa: E731
    killed = root / f"killed-{n}"
    shutil.copytree(folder, killed)
    proc = run_killed(args(killed), point)
    assert proc.returncode != 0, f"{point}: not killed"
    undone = root / f"undone-{n}"
    shutil.copytree(killed, undone)
    restored = ckptfix("restore", str(undone))
    assert restored.returncode in (0, 2), restored.stderr
    if restored.returncode == 2:
        assert "no in-place repair to undo" in restored.stderr, restored.stderr
    assert snapshot(undone) == original, f"{point}: restore did not give the original back"
    rerun = ckptfix(*args(killed))
    assert rerun.returncode == 0, f"{point}: rerun exit {rerun.returncode}: {rerun.stderr[-800:]}"
    assert without_ours(snapshot(killed)) == without_ours(snapshot(repaired)), f"{point}: rerun differs"
    ckptfix("restore", str(killed), check=True)
    assert snapshot(killed) == original, f"{point}: the rerun's restore"


def _kill_restore(case, point: KillPoint, n: int) -> None:
    root, folder, tok, original, repaired = case
    killed = root / f"restore-killed-{n}"
    shutil.copytree(repaired, killed)
    proc = run_killed(["restore", str(killed)], point)
    assert proc.returncode != 0, f"{point}: not killed"
    again = ckptfix("restore", str(killed))
    assert again.returncode == 0 or "no in-place repair to undo" in again.stderr, again.stderr
    assert snapshot(killed) == original, f"{point}: restore run again did not give the original back"


_TRACED: dict = {}


def _points(case, args_for, name, most):
    root = case[0]
    probe = root / f"probe-{name}"
    if (root, name) not in _TRACED:
        shutil.copytree(case[1] if name == "repair" else case[4], probe)
        _TRACED[root, name] = kill_points(args_for(probe), probe, root / f"{name}.strace")
    points = _TRACED[root, name]
    assert points, "the clean traced run made no call in the folder"
    # the same call numbers hold for any copy: the run's calls do not depend on the folder's name
    return points if most is None else spread(points, most)


@pytest.mark.slow
@pytest.mark.parametrize("most", [pytest.param(5, id="slice"), pytest.param(None, id="every", marks=pytest.mark.long)])
def test_in_place_repair_killed_at_each_point(case, most):
    tok = case[2]
    points = _points(case, lambda f: ["repair", str(f), "-t", str(tok), "--in-place", "--keep-ids"], "repair", most)
    for n, point in enumerate(points):
        _kill_repair(case, point, n)
    print(f"\nrepair --in-place ({case[1].name}): {len(points)} kill points, each restored bit-identical "
          "and rerun equal to the clean run")


@pytest.mark.slow
@pytest.mark.parametrize("most", [pytest.param(3, id="slice"), pytest.param(None, id="every", marks=pytest.mark.long)])
def test_restore_killed_at_each_point(case, most):
    points = _points(case, lambda f: ["restore", str(f)], "restore", most)
    for n, point in enumerate(points):
        _kill_restore(case, point, n)
    print(f"\nrestore ({case[1].name}): {len(points)} kill points, each finished by running it again")


def _fail_repair(case, point: KillPoint, n: int, fault: str) -> None:
    """A failed call (EIO, ENOSPC) at `point`: one line and exit 2, or the repair done (a failure it may
    ride out, e.g. of a temp's removal); the folder as it was or, where the line says so, restorable; a rerun
    equal to the clean run."""
    root, folder, tok, original, repaired = case
    args = ["repair", "-t", str(tok), "--in-place", "--keep-ids"]
    failed = root / f"failed-{fault}-{n}"
    shutil.copytree(folder, failed)
    proc = run_killed([args[0], str(failed), *args[1:]], point, f"error={fault}")
    assert proc.returncode in (0, 2), f"{point} {fault}: exit {proc.returncode}: {proc.stderr[-1500:]}"
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 1, proc.stderr[-1500:]
    if proc.returncode == 2:
        if "ckptfix restore" in proc.stderr:
            ckptfix("restore", str(failed), check=True)
        assert snapshot(failed) == original, f"{point} {fault}: the folder was not put back: {proc.stderr}"
    rerun = ckptfix(args[0], str(failed), *args[1:])
    if proc.returncode == 2:
        assert rerun.returncode == 0, f"{point} {fault}: rerun exit {rerun.returncode}: {rerun.stderr[-800:]}"
    assert without_ours(snapshot(failed)) == without_ours(snapshot(repaired)) or proc.returncode == 0, point


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["EIO", "ENOSPC"])
@pytest.mark.parametrize("most", [pytest.param(3, id="slice"), pytest.param(None, id="every", marks=pytest.mark.long)])
def test_in_place_repair_failing_at_each_point(case, most, fault):
    tok = case[2]
    points = _points(case, lambda f: ["repair", str(f), "-t", str(tok), "--in-place", "--keep-ids"], "repair", most)
    for n, point in enumerate(points):
        _fail_repair(case, point, n, fault)
    print(f"\nrepair --in-place ({case[1].name}): {fault} at {len(points)} points, each one line and the folder "
          "put back")
