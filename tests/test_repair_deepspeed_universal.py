"""Repair of a DeepSpeed universal checkpoint, resumed by DeepSpeed itself at another world size.

A real ZeRO-2 (and ZeRO-3) run on two CPU ranks (gloo) trains a tiny LM with an untied head and saves with
`engine.save_checkpoint`; DeepSpeed's own `ds_to_universal` (with `--inject_missing_state`, which an
engine save needs) converts it; `ckptfix repair` grows, shrinks or remaps the vocab; a new DeepSpeed
run with `"checkpoint": {"load_universal": true}` loads the repaired folder on one or two ranks and
takes one step. Old rows of the fp32 weights and of both Adam moments must equal the source's
(DeepSpeed's own `safe_get_full_*` view, before and after), the step count carries over, the step is
finite. The same for a ZeRO-3 run (flat per-parameter files, one model-states file per rank).
"""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
import torch
from deepspeed_lm import PRELUDE
from procs import NO_SHM_BUILD, run, run_ranks
from test_formats_deepspeed_ranks import VOCAB, _free_port, run_zero

from ckptfix.cli import main
from ckptfix.errors import RepairError
from ckptfix.formats import detect, read_checkpoint

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.deepspeed, pytest.mark.long]

_CONVERT = textwrap.dedent("""
    import argparse, sys
    from deepspeed.checkpoint.ds_to_universal import main
    main(argparse.Namespace(input_folder=sys.argv[1], output_folder=sys.argv[2], num_extract_workers=1,
                            num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True))
""")

_RESUME = PRELUDE + NO_SHM_BUILD + textwrap.dedent("""
    import os, sys
    import torch
    import deepspeed
    from torch import nn
    from deepspeed_lm import LM, config, full_view
    load_dir, tag, stage, vocab, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    torch.manual_seed(1)  # other initial values than the saved run: everything must come from the folder
    deepspeed.init_distributed(dist_backend="gloo")
    model = LM(vocab)
    engine, _, _, sched = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=config(stage, checkpoint={"load_universal": True}))
    path, _ = engine.load_checkpoint(load_dir, tag=tag)
    assert path is not None, "load_checkpoint found nothing"
    loaded, steps, sched_iter = full_view(engine), engine.global_steps, sched.last_batch_iteration
    module = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    ids = torch.randint(0, vocab, (2, 6), generator=g)
    loss = nn.functional.cross_entropy(engine(ids[:, :-1]).reshape(-1, vocab), ids[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()
    after = {n: v["fp32"] for n, v in full_view(engine).items()}
    if int(os.environ["RANK"]) == 0:
        torch.save({"loaded": loaded, "module": module, "steps": steps, "sched_iter": sched_iter,
                    "loss": float(loss), "after": after}, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    os._exit(0)
""")



def _ranks(args: list[str], world: int) -> None:
    base = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
            "WORLD_SIZE": str(world), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    ranks = run_ranks([sys.executable, "-c", *args], [{**base, "RANK": str(r), "LOCAL_RANK": str(r)}
                                                      for r in range(world)], timeout=300)
    if any(rc for rc, _ in ranks):
        pytest.fail("deepspeed run failed:\n" + "\n".join(f"rank {r} ({rc}): {err[-3000:]}" for r, (rc, err)
                                                          in enumerate(ranks) if rc))


def _tokenizer(path, words: list[str]):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0])).save(str(path))
    return str(path)


OLD_WORDS = ["[UNK]"] + [f"w{i}" for i in range(1, VOCAB)]


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def universal(request, tmp_path_factory):
    """A 2-rank ZeRO save converted by DeepSpeed's ds_to_universal; DeepSpeed's view of every parameter."""
    stage = request.param
    root = tmp_path_factory.mktemp(f"dsu{stage}")
    truth = run_zero(root / "run", stage)
    folder = root / "global_step3_universal"
    run([sys.executable, "-c", _CONVERT, str(root / "run" / "global_step3"), str(folder)], check=True, timeout=300,
        env={**os.environ, "DS_ACCELERATOR": "cpu"})
    return root, folder, truth, stage


def _repair_and_resume(universal, tmp_path, words: list[str], world: int, extra: tuple = ()) -> dict:
    root, folder, _, stage = universal
    tok = _tokenizer(tmp_path / "tok.json", words)
    out = root / f"fixed-{tmp_path.name}"
    main(["repair", str(folder), "-t", tok, "-o", str(out), *extra])
    assert detect(str(out)) == "deepspeed-universal"
    result = tmp_path / "resumed.pt"
    _ranks([_RESUME, str(root), out.name, str(stage), str(len(words)), str(result)], world)
    return torch.load(result)


def _check(resumed: dict, truth: dict, source_row: list[int]) -> None:
    """Each new row j that comes from old row source_row[j] (-1: new) holds that row, in weights and moments."""
    assert resumed["steps"] == 3 and resumed["sched_iter"] == 2  # three steps before the save
    assert torch.isfinite(torch.tensor(resumed["loss"]))
    assert all(torch.isfinite(v).all() for v in resumed["after"].values())
    for name, want in truth.items():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            got = resumed["loaded"][name][key]
            if name in ("embed_tokens.weight", "lm_head.weight"):
                assert got.shape[0] == len(source_row)
                for j, i in enumerate(source_row):
                    if i >= 0:
                        assert torch.equal(got[j], want[key][i]), (name, key, j, i)
                new = [j for j, i in enumerate(source_row) if i < 0]
                if key == "exp_avg" and new:
                    assert torch.count_nonzero(got[new]) == 0
                if key == "exp_avg_sq" and new:  # the old rows' column mean, never zero
                    assert bool((got[new] > 0).all())
            else:
                assert torch.equal(got, want[key]), (name, key)
        assert torch.equal(resumed["module"][name], resumed["loaded"][name]["fp32"])


def test_grow_then_resume_on_one_rank(universal, tmp_path):
    words = OLD_WORDS + [f"new{i}" for i in range(16)]
    resumed = _repair_and_resume(universal, tmp_path, words, world=1)
    _check(resumed, universal[2], list(range(VOCAB)) + [-1] * 16)


def test_shrink_then_resume_on_two_ranks(universal, tmp_path):
    resumed = _repair_and_resume(universal, tmp_path, OLD_WORDS[:40], world=2)
    _check(resumed, universal[2], list(range(40)))


def test_token_string_remap_then_resume_on_one_rank(universal, tmp_path):
    old = _tokenizer(tmp_path / "old.json", OLD_WORDS)
    # the new tokenizer drops w5..w9, moves w40..w47 to the front after [UNK], adds 3 tokens
    words = ["[UNK]"] + OLD_WORDS[40:] + [w for w in OLD_WORDS[1:40] if w not in {f"w{i}" for i in range(5, 10)}]
    words += ["x0", "x1", "x2"]
    resumed = _repair_and_resume(universal, tmp_path, words, world=1, extra=("--from-tokenizer", old))
    index = {w: i for i, w in enumerate(OLD_WORDS)}
    _check(resumed, universal[2], [index.get(w, -1) for w in words])


def test_policies_that_drop_moments_are_refused_before_writing(universal, tmp_path):
    folder = universal[1]
    tok = _tokenizer(tmp_path / "tok.json", OLD_WORDS + ["z"])
    with pytest.raises(SystemExit) as exc:
        main(["repair", str(folder), "-t", tok, "--policy", "fresh", "--dry-run"])
    assert exc.value.code == 2
    from ckptfix import repair

    with pytest.raises(RepairError, match="load_universal needs every parameter's moments"):
        repair(str(folder), tok, tmp_path / "out", policy="reset")
    assert not (tmp_path / "out").exists()


def test_the_universal_folder_reads_per_parameter(universal):
    _, folder, truth, _ = universal
    ckpt = read_checkpoint(folder)
    assert ckpt.format == "deepspeed-universal" and set(ckpt.model) == set(truth)
    for name, want in truth.items():
        assert torch.equal(torch.from_numpy(ckpt.model[name].read().copy()), want["fp32"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(torch.from_numpy(ckpt.optimizer.state[name].tensors[key].read().copy()), want[key])
