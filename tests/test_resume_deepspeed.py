"""Issue 42: what a real DeepSpeed `engine.save_checkpoint` folder lacks for `engine.load_checkpoint` (CKF319), or
holds torn.

One module-scoped DeepSpeed process (CPU, one rank, ZeRO-2, AdamW + WarmupLR, 3 steps) saves, then copies the save once
per case, removes, halves or empties one file in the copy and runs `engine.load_checkpoint(copy)` on a fresh engine,
recording what it did; ckptfix's finding (or one-line refusal) on the same copy must name the file and say it.
Measured (DeepSpeed 0.19.8, torch 2.13):

    file                                         removed                            halved / empty
    latest                                       returns (None, None): nothing      AssertionError (no message)
                                                 loaded, step 0 (a warning only)
    global_stepN/mp_rank_00_model_states.pt      AssertionError (no message)        RuntimeError 'PytorchStreamReader
    global_stepN/zero_pp_rank_0_..._optim_states FileNotFoundError                  ...' / EOFError
"""

from __future__ import annotations

import json
import os
import socket
import sys
import textwrap

import pytest
from procs import NO_SHM_BUILD, run

from ckptfix.errors import CkptfixError
from ckptfix.inspect import inspect
from ckptfix.latest import latest_checkpoint

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.deepspeed

FILES = ("latest", "global_step3/mp_rank_00_model_states.pt", "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt")
HOWS = ("removed", "half", "zero")

_SCRIPT = NO_SHM_BUILD + textwrap.dedent("""
    import json, os, shutil, sys
    import torch, deepspeed
    from torch import nn
    out = sys.argv[1]
    files, hows = json.loads(sys.argv[2]), json.loads(sys.argv[3])
    def engine():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        cfg = {"train_micro_batch_size_per_gpu": 2,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
               "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
               "zero_optimization": {"stage": 2}}
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    def resume(d):
        e = engine()
        try:
            path, _ = e.load_checkpoint(d)
        except Exception as exc:
            return [type(exc).__name__, str(exc)]
        return ["ok", {"path": path, "global_steps": e.global_steps}]
    e = engine()
    for _ in range(3):
        e.backward(e(torch.randn(2, 4)).pow(2).mean())
        e.step()
    src = os.path.join(out, "whole")
    e.save_checkpoint(src)
    results = {"whole": resume(src)}
    for f in files:
        for how in hows:
            case = f"{how}-{f.replace('/', '-')}"
            d = os.path.join(out, case)
            shutil.copytree(src, d)
            p = os.path.join(d, f)
            if how == "removed":
                os.remove(p)
            else:
                data = open(p, "rb").read()
                open(p, "wb").write(data[: len(data) // 2] if how == "half" else b"")
            results[case] = resume(d)
    json.dump(results, open(os.path.join(out, "results.json"), "w"))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds_resume")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = run([sys.executable, "-c", _SCRIPT, str(out), json.dumps(FILES), json.dumps(HOWS)], env=env, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"deepspeed run failed:\n{proc.stderr[-3000:]}")
    return out, json.loads((out / "results.json").read_text())


def test_healthy_save_has_no_finding_and_resumes(measured):
    out, results = measured
    assert results["whole"] == ["ok", {"path": str(out / "whole" / "global_step3" / "mp_rank_00_model_states.pt"),
                                       "global_steps": 3}]
    for target in (out / "whole", out / "whole" / "global_step3"):
        assert not [f for f in inspect(str(target)).findings if f.code == "CKF319"]
    assert latest_checkpoint(out / "whole").path == str(out / "whole" / "global_step3")


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("how", HOWS)
def test_damaged_file_is_named_with_what_load_checkpoint_does(measured, name, how):
    out, results = measured
    case = f"{how}-{name.replace('/', '-')}"
    outcome, detail = results[case]
    base = os.path.basename(name)
    try:
        report = inspect(str(out / case))
    except CkptfixError as exc:
        text = str(exc)
        assert "\n" not in text and "engine.load_checkpoint" in text and outcome in text
        assert base in text or (name.endswith("model_states.pt") and "model_states.pt file in" in text)
        if outcome == "AssertionError":
            assert detail == "" and "AssertionError with no message" in text
        return
    hits = [f for f in report.findings if f.code == "CKF319"]
    assert len(hits) == 1 and base in hits[0].message and report.exit_code == 1
    if name == "latest":  # silently nothing loaded: training would start again at step 0
        assert (outcome, detail) == ("ok", {"path": None, "global_steps": 0})
        assert "returns (None, None)" in hits[0].pytorch and "from scratch" in hits[0].pytorch
    else:
        assert outcome == "FileNotFoundError" and base in detail and "FileNotFoundError" in hits[0].pytorch
    assert (how, name) in {("removed", "latest"), ("removed", FILES[2])}


def test_latest_skips_a_tag_missing_a_partition(measured, tmp_path):
    out, _ = measured
    import shutil

    run_dir = tmp_path / "save"
    shutil.copytree(out / "whole", run_dir)
    shutil.copytree(out / "whole" / "global_step3", run_dir / "global_step6")
    os.remove(run_dir / "global_step6" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (run_dir / "latest").write_text("global_step6")
    result = latest_checkpoint(run_dir)
    assert result.path == str(run_dir / "global_step3")
    assert result.checked[0].reasons == ["no *optim_states.pt"]


# --- the universal folder (ds_to_universal of a 2-rank ZeRO-2 save), resumed with load_universal on one rank ----------

UNIVERSAL_FILES = ("mp_rank_00_model_states.pt", "zero/optimizer_state.pt", "zero/lm_head.weight/fp32.pt",
                   "zero/lm_head.weight/exp_avg.pt", "zero/lm_head.weight/exp_avg_sq.pt", "zero/lm_head.weight/step.pt")

_UNIVERSAL_RESUME = NO_SHM_BUILD + textwrap.dedent("""
    import json, os, shutil, sys
    sys.path.insert(0, sys.argv[4])
    import torch, deepspeed
    from deepspeed_lm import LM, config, full_view
    from test_formats_deepspeed_ranks import VOCAB
    root, files, hows = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    src = os.path.join(root, "global_step3_universal")
    saved = torch.load(os.path.join(src, "zero", "lm_head.weight", "fp32.pt"), weights_only=False)["param"]
    deepspeed.init_distributed(dist_backend="gloo")
    def resume(tag):
        torch.manual_seed(1)
        model = LM(VOCAB)
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config(2, checkpoint={"load_universal": True}))[0]
        try:
            engine.load_checkpoint(root, tag=tag)
        except Exception as exc:
            return [type(exc).__name__, str(exc)]
        return ["ok", {"global_steps": engine.global_steps,
                       "lm_head_as_saved": torch.equal(full_view(engine)["lm_head.weight"]["fp32"], saved)}]
    results = {"whole": resume("global_step3_universal")}
    for f in files:
        for how in hows:
            case = f"{how}-{f.replace('/', '-')}"
            shutil.copytree(src, os.path.join(root, case))
            p = os.path.join(root, case, f)
            if how == "removed":
                os.remove(p)
            else:
                data = open(p, "rb").read()
                open(p, "wb").write(data[: len(data) // 2] if how == "half" else b"")
            results[case] = resume(case)
    json.dump(results, open(os.path.join(root, "results.json"), "w"))
""")


@pytest.fixture(scope="module")
def universal(tmp_path_factory):
    from test_formats_deepspeed_ranks import run_zero
    from test_repair_deepspeed_universal import _CONVERT

    root = tmp_path_factory.mktemp("dsu_resume")
    run_zero(root / "run", 2)
    run([sys.executable, "-c", _CONVERT, str(root / "run" / "global_step3"), str(root / "global_step3_universal")],
        check=True, timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = run([sys.executable, "-c", _UNIVERSAL_RESUME, str(root), json.dumps(UNIVERSAL_FILES), json.dumps(HOWS),
                os.path.dirname(__file__)], env=env, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"deepspeed run failed:\n{proc.stderr[-3000:]}")
    return root, json.loads((root / "results.json").read_text())


@pytest.mark.long  # a two-rank run
@pytest.mark.slow
@pytest.mark.parametrize("name", UNIVERSAL_FILES)
@pytest.mark.parametrize("how", HOWS)
def test_universal_folder_damaged_file_is_named_with_what_load_universal_does(universal, name, how):
    root, results = universal
    assert results["whole"] == ["ok", {"global_steps": 3, "lm_head_as_saved": True}]
    assert not [f for f in inspect(str(root / "global_step3_universal")).findings if f.code == "CKF319"]
    case = f"{how}-{name.replace('/', '-')}"
    outcome, detail = results[case]
    try:
        report = inspect(str(root / case))
    except CkptfixError as exc:
        text = str(exc)
        assert "\n" not in text and "engine.load_checkpoint" in text and outcome in text
        assert os.path.basename(name) in text or (name.endswith("model_states.pt") and "model_states.pt file" in text)
        return
    (hit,) = [f for f in report.findings if f.code == "CKF319"]
    assert how == "removed" and name in hit.message and report.exit_code == 1
    if name.endswith("fp32.pt"):  # loaded without a word, the parameter left at the new run's initialisation
        assert outcome == "ok" and detail == {"global_steps": 3, "lm_head_as_saved": False}
        assert "without a word" in hit.pytorch and "initialisation" in hit.pytorch
    else:
        assert outcome in hit.pytorch and detail.split(" [")[0][:20] in hit.pytorch
