"""ResumeGuard on real checkpoints: tiny LMs trained with real AdamW, LambdaLR and GradScaler
state, saved with torch.save, resumed into fresh live objects and trained further."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from ckpt_factory import TinyLM, lm_loss, make_batches, new_run, save_checkpoint, train
from torch import nn

from ckptfix.errors import UnsafePickle
from ckptfix.formats import read_checkpoint
from ckptfix.guard import (
    POLICIES,
    ResumeError,
    ResumeGuard,
    ResumeReport,
    TrainingSetupError,
    TrainingSetupWarning,
)

# One-off imports paid at collection, as test_hf_callback.py does: the first optimizer built in
# a process imports torch._dynamo (~2 s), the first transformers import takes ~2 s.
torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
try:
    import transformers

    transformers.PreTrainedTokenizerFast  # noqa: B018 - force the lazy import
except ImportError:
    transformers = None

V_OLD, V_NEW = 1001, 1000  # seed 001: checkpoint saved with one token more than the tokenizer
STEPS = 12  # saved checkpoints are at step 12: past the 10-step LambdaLR warmup (lr = 3e-3)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def guarded_steps(run, guard: ResumeGuard, batches, lrs: list | None = None) -> list[float]:
    """The ckpt_factory training step, with the guard's hooks around the optimizer step."""
    losses = []
    for ids in batches:
        run.optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(run.model, ids)
        run.scaler.scale(loss).backward()
        guard.before_step()
        run.scaler.step(run.optimizer)
        run.scaler.update()
        guard.after_step()
        run.scheduler.step()
        losses.append(loss.item())
    return losses


def record_lrs(optimizer) -> list[float]:
    """The lr of group 0 as optimizer.step() sees it (a pre-hook registered after the guard's)."""
    seen: list[float] = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(opt.param_groups[0]["lr"]))
    return seen


def clean(fn, *args, **kwargs):
    """Run fn with every TrainingSetupWarning turned into an error (no false alarms)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrainingSetupWarning)
        return fn(*args, **kwargs)


def wordlevel_tokenizer(path: Path, size: int) -> Path:
    """A tokenizer.json with exactly `size` tokens (ids 0..size-1)."""
    doc = {"version": "1.0", "added_tokens": [], "normalizer": None, "pre_tokenizer": None,
           "model": {"type": "WordLevel", "unk_token": "t0", "vocab": {f"t{i}": i for i in range(size)}}}
    path.write_text(json.dumps(doc))
    return path


def decreasing(losses: list[float]) -> bool:
    k = max(2, len(losses) // 4)
    return all(math.isfinite(x) for x in losses) and sum(losses[-k:]) / k < sum(losses[:k]) / k


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints written once per module: same vocab, and the seed-001 vocab mismatch."""
    d = tmp_path_factory.mktemp("resume")
    same = train(new_run(V_NEW), STEPS)
    same_path = save_checkpoint(same, d / "same.pth")
    ref_losses = train(same, 10, batches=make_batches(V_NEW, 10, seed=7)).losses[-10:]
    old = train(new_run(V_OLD), STEPS)
    old_path = save_checkpoint(old, d / "vocab1001.pth")
    return {"dir": d, "same": same_path, "same_ref_losses": ref_losses, "old": old_path}


def fresh_run(vocab: int = V_NEW, **kw):
    return new_run(vocab, seed=123, **kw)  # other random weights than the saved run


# ---------------------------------------------------------------------------------------------
# a correct resume: clean with every policy, training continues
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_correct_resume_is_clean_with_every_policy(saved, policy):
    run = fresh_run()
    guard = ResumeGuard(run.model, run.optimizer, run.scheduler, run.scaler, tokenizer=V_NEW,
                        policy=policy)
    report = clean(guard.load, saved["same"])
    assert isinstance(report, ResumeReport)
    assert report.problems == [] and report.rewarm_steps == 0
    assert report.extras == {"epoch": 1, "step": STEPS}
    ckpt = read_checkpoint(saved["same"])
    for name, value in run.model.state_dict().items():
        assert torch.equal(value, ckpt.model[name].to_torch()), name
    json.dumps(report.to_json())

    batches = make_batches(V_NEW, 10, seed=7)
    losses = clean(guarded_steps, run, guard, batches)
    assert guard.probe is not None and guard.probe.problems == [] and not guard.probe.active
    if policy == "reset":
        assert run.scheduler.last_epoch == 10  # the schedule started again
        assert decreasing(losses)
    else:
        # optimizer, scheduler and scaler state restored exactly: the resumed run is the run
        assert losses == saved["same_ref_losses"]
        assert report.optimizer_matched_by == "names (inferred)"


# ---------------------------------------------------------------------------------------------
# seed 001: checkpoint with 1001 embedding rows, model and tokenizer with 1000
# ---------------------------------------------------------------------------------------------


def test_vocab_mismatch_strict_raises_naming_the_embedding_before_loading(saved):
    run = fresh_run()
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    guard = ResumeGuard(run.model, run.optimizer, run.scheduler, run.scaler, tokenizer=V_NEW)
    with pytest.raises(ResumeError) as err:
        guard.load(saved["old"])
    codes = {p.code for p in err.value.problems}
    assert codes == {"CKF825"}
    assert "text_embedding.weight" in err.value.problems[0].params
    assert "text_embedding.weight [1001, 16] vs [1000, 16]" in str(err.value)
    assert isinstance(err.value, TrainingSetupError)
    for k, v in run.model.state_dict().items():  # nothing was modified
        assert torch.equal(v, before[k])
    assert run.optimizer.state_dict()["state"] == {}


def test_vocab_mismatch_remap_resizes_weights_and_moments(saved):
    run = fresh_run()
    guard = ResumeGuard(run.model, run.optimizer, run.scheduler, run.scaler, tokenizer=V_NEW,
                        policy="remap")
    with pytest.warns(TrainingSetupWarning, match="CKF825"):
        report = guard.load(saved["old"])
    assert [p.code for p in report.problems] == ["CKF825"]
    assert any("resized text_embedding.weight [1001, 16] -> [1000, 16]" in a for a in report.actions)
    assert report.rewarm_steps == 0

    ckpt = read_checkpoint(saved["old"])
    opt = ckpt.optimizer
    names = list(dict(run.model.named_parameters()))
    for i, name in enumerate(names):  # the optimizer was built from model.parameters()
        param = dict(run.model.named_parameters())[name]
        live = run.optimizer.state[param]
        saved_w = ckpt.model[name].to_torch()
        rows = min(saved_w.shape[0], param.shape[0])
        assert torch.equal(param.detach()[:rows], saved_w[:rows]), name  # old rows bit-identical
        for key in ("exp_avg", "exp_avg_sq"):
            saved_m = opt.state[i].tensors[key].to_torch()
            assert live[key].shape == param.shape
            assert torch.equal(live[key][:rows], saved_m[:rows]), (name, key)
        assert float(live["step"]) == STEPS

    losses = clean(guarded_steps, run, guard, make_batches(V_NEW, 12, seed=7))
    assert decreasing(losses) and guard.probe.problems == []


def test_padded_checkpoint_resizes_to_the_live_models_rows(tmp_path):
    """A checkpoint padded to 1024 rows (pad_to_multiple_of=64) into a model built with len(tokenizer) = 1000:
    the guard resizes to the model's 1000 rows, not to the 1024 a repair's padding rule would keep."""
    padded = save_checkpoint(train(new_run(1024), 3), tmp_path / "padded.pth")
    run = fresh_run()
    guard = ResumeGuard(run.model, run.optimizer, run.scheduler, run.scaler, tokenizer=V_NEW, policy="remap")
    with pytest.warns(TrainingSetupWarning, match="CKF825"):
        report = guard.load(padded)
    assert any("resized text_embedding.weight [1024, 16] -> [1000, 16]" in a for a in report.actions)
    assert any("padding rule: the live model's row count" in n for n in report.notes)
    saved_w = read_checkpoint(padded).model["text_embedding.weight"].to_torch()
    assert torch.equal(run.model.text_embedding.weight.detach(), saved_w[:V_NEW])


def test_vocab_mismatch_fresh_optimizer_rewarms_the_lr(saved):
    run = fresh_run()
    guard = ResumeGuard(run.model, run.optimizer, run.scheduler, run.scaler, tokenizer=V_NEW,
                        policy="fresh-optimizer", rewarm_steps=5)
    with pytest.warns(TrainingSetupWarning, match="CKF825"):
        report = guard.load(saved["old"])
    assert report.rewarm_steps == 5 and report.optimizer_matched_by == "dropped"
    assert run.optimizer.state_dict()["state"] == {}
    ckpt = read_checkpoint(saved["old"])
    emb = ckpt.model["text_embedding.weight"].to_torch()
    assert torch.equal(run.model.text_embedding.weight.detach(), emb[:V_NEW])
    assert run.scheduler.last_epoch == STEPS  # the schedule position is kept

    base = run.optimizer.param_groups[0]["lr"]
    assert base == pytest.approx(3e-3)  # LambdaLR warmup (10 steps) is over
    seen = record_lrs(run.optimizer)
    losses = clean(guarded_steps, run, guard, make_batches(V_NEW, 8, seed=7))
    assert seen == pytest.approx([base * k / 5 for k in (1, 2, 3, 4, 5)] + [base] * 3)
    assert run.optimizer.param_groups[0]["lr"] == pytest.approx(base)  # scheduler's lr untouched
    assert guard.lr_factor == 1.0 and all(math.isfinite(x) for x in losses)


def test_fresh_optimizer_can_reset_the_scheduler(saved):
    run = fresh_run()
    guard = ResumeGuard(run.model, run.optimizer, run.scheduler, run.scaler, tokenizer=V_NEW,
                        policy="fresh-optimizer", rewarm_steps=4, reset_scheduler=True)
    with pytest.warns(TrainingSetupWarning):
        report = guard.load(saved["old"])
    assert run.scheduler.last_epoch == 0 and report.rewarm_steps == 4
    assert "kept the scheduler's fresh state (reset)" in report.actions


def test_tokenizer_larger_than_the_embedding_is_an_error_in_every_policy(saved, tmp_path):
    tok = wordlevel_tokenizer(tmp_path / "tokenizer.json", V_NEW + 5)
    for policy in POLICIES:
        run = fresh_run()
        guard = ResumeGuard(run.model, run.optimizer, run.scheduler, run.scaler, tokenizer=tok,
                            policy=policy)
        with pytest.raises(ResumeError, match="CKF824") as err:
            guard.load(saved["same"])
        assert err.value.problems[0].params == ("text_embedding.weight",)


def test_tokenizer_as_path_info_and_hf_object(saved, tmp_path):
    from ckptfix.tokenizers import load_tokenizer

    path = wordlevel_tokenizer(tmp_path / "tokenizer.json", V_NEW)
    tokenizers = [path, str(path), load_tokenizer(path), V_NEW]
    if transformers is None:
        pytest.skip("transformers is not installed")
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(V_NEW)}
    tokenizers.append(transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0"))))
    for tok in tokenizers:
        run = fresh_run()
        report = clean(ResumeGuard(run.model, run.optimizer, run.scheduler, run.scaler,
                                   tokenizer=tok).load, saved["same"])
        assert report.problems == []


# ---------------------------------------------------------------------------------------------
# the user's own (shape-filtered) loading code
# ---------------------------------------------------------------------------------------------


def test_shape_filtered_load_is_caught_by_verify_loaded(saved):
    run = fresh_run()
    # what the seed-001 "fix" does: load whatever fits, silently skip the rest
    sd = torch.load(saved["old"], map_location="cpu", weights_only=True)["model"]
    model_sd = run.model.state_dict()
    run.model.load_state_dict({k: v for k, v in sd.items() if v.shape == model_sd[k].shape},
                              strict=False)
    guard = ResumeGuard(run.model, run.optimizer)
    with pytest.raises(ResumeError) as err:
        guard.verify_loaded(saved["old"])
    [problem] = err.value.problems
    assert problem.code == "CKF820"
    assert set(problem.params) == {"text_embedding.weight", "text_head.weight"}
    assert "text_embedding.weight [1001, 16] in the checkpoint, [1000, 16] in the model" in str(err.value)


def test_verify_loaded_passes_after_a_complete_load_and_catches_partial_ones(saved):
    run = fresh_run()
    sd = torch.load(saved["same"], map_location="cpu", weights_only=True)
    run.model.load_state_dict(sd["model"])
    run.optimizer.load_state_dict(sd["optimizer"])
    guard = ResumeGuard(run.model, run.optimizer)
    assert clean(guard.verify_loaded, saved["same"]) == []
    assert clean(guard.verify_loaded, saved["same"], full=True) == []

    # a key renamed in the model's code: strict=False loads everything else
    other = fresh_run()
    renamed = {("blocks.1.3.weight_old" if k == "blocks.1.3.weight" else k): v
               for k, v in sd["model"].items()}
    other.model.load_state_dict(renamed, strict=False)
    problems = ResumeGuard(other.model).verify_loaded(saved["same"], raise_on_error=False)
    assert {(p.code, p.severity) for p in problems} == {("CKF820", "error")}
    assert problems[0].params == ("blocks.1.3.weight",)


def test_verify_loaded_accepts_rows_resized_by_the_user(saved):
    run = fresh_run()
    sd = torch.load(saved["old"], map_location="cpu", weights_only=True)["model"]
    run.model.load_state_dict({k: (v[:V_NEW] if v.shape[0] == V_OLD else v) for k, v in sd.items()})
    problems = ResumeGuard(run.model).verify_loaded(saved["old"], raise_on_error=False)
    assert [(p.code, p.severity) for p in problems] == [("CKF825", "warning")]


# ---------------------------------------------------------------------------------------------
# optimizer state mapped onto the wrong parameters
# ---------------------------------------------------------------------------------------------


class TwoPath(nn.Module):
    """Two same-shape Linear layers; `swapped` registers them in the other order."""

    def __init__(self, vocab: int = 40, dim: int = 8, swapped: bool = False):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        for name in (("down", "up") if swapped else ("up", "down")):
            setattr(self, name, nn.Linear(dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        h = self.embedding(ids)
        h = h + torch.tanh(self.up(h))
        h = h + self.down(h)
        return self.head(h)


def _two_path_checkpoint(path: Path, record: bool, vocab: int = 40) -> dict:
    torch.manual_seed(0)
    model = TwoPath(vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for ids in make_batches(40, 6, seed=3):
        opt.zero_grad()
        lm_loss(model, ids).backward()
        opt.step()
    obj = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 6}
    if record:
        obj["ckptfix"] = ResumeGuard(model, opt).record()
    torch.save(obj, path)
    names = list(dict(model.named_parameters()))
    return {n: opt.state[p] for n, p in zip(names, model.parameters())}


@pytest.mark.parametrize("record", [True, False], ids=["recorded-names", "inferred-names"])
def test_swapped_registration_order_is_caught(tmp_path, record):
    path = tmp_path / "twopath.pth"
    saved_state = _two_path_checkpoint(path, record)

    # what torch does on its own: positional loading succeeds silently, state goes to the wrong layer
    model = TwoPath(swapped=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.load_state_dict(torch.load(path, weights_only=True)["optimizer"])
    assert torch.equal(opt.state[model.down.weight]["exp_avg"], saved_state["up.weight"]["exp_avg"])

    model = TwoPath(swapped=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ResumeError, match="CKF822") as err:
        ResumeGuard(model, opt).load(path)
    [problem] = err.value.problems
    assert set(problem.params) == {"down.weight", "down.bias", "up.weight", "up.bias"}
    assert "down.weight <- state of up.weight" in problem.message
    assert ("recorded in the checkpoint" if record else "inferred") in problem.message

    # remap: each parameter gets the state saved under its own name
    model = TwoPath(swapped=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.warns(TrainingSetupWarning, match="CKF822"):
        report = ResumeGuard(model, opt, policy="remap").load(path)
    assert report.optimizer_matched_by == f"names ({'recorded' if record else 'inferred'})"
    for name, param in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[param][key], saved_state[name][key]), (name, key)

    # fresh-optimizer: drop the state
    model = TwoPath(swapped=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.warns(TrainingSetupWarning, match="CKF822"):
        report = ResumeGuard(model, opt, policy="fresh-optimizer", rewarm_steps=3).load(path)
    assert opt.state_dict()["state"] == {} and report.rewarm_steps == 3


def test_swapped_order_is_caught_through_a_repair_record(tmp_path):
    """`ckptfix repair` (vocab 41 -> 40) records parameter names; model B registers up/down in
    the other order: the guard catches the swap and remap gives each layer its own moments."""
    from ckptfix.surgery import repair

    source = tmp_path / "twopath41.pth"
    saved_state = _two_path_checkpoint(source, record=False, vocab=41)
    out = tmp_path / "twopath40.pth"
    tok = wordlevel_tokenizer(tmp_path / "tokenizer.json", 40)
    assert repair(source, tok, out).record["param_names"][1:5] == [
        "up.weight", "up.bias", "down.weight", "down.bias"]

    model = TwoPath(40, swapped=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ResumeError, match="CKF822") as err:
        ResumeGuard(model, opt, tokenizer=tok).load(out)
    assert "down.weight <- state of up.weight" in str(err.value)

    model = TwoPath(40, swapped=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.warns(TrainingSetupWarning, match="CKF822"):
        ResumeGuard(model, opt, tokenizer=tok, policy="remap").load(out)
    for name in ("up.weight", "down.weight", "up.bias", "down.bias"):
        param = model.get_parameter(name)
        assert torch.equal(opt.state[param]["exp_avg"], saved_state[name]["exp_avg"]), name
    emb = opt.state[model.embedding.weight]["exp_avg"]
    assert torch.equal(emb, saved_state["embedding.weight"]["exp_avg"][:40])


def test_without_names_a_shape_permutation_is_caught(tmp_path):
    """The live optimizer is not in model order (custom param order), so names cannot be inferred:
    positions are checked by shape, and a fit only under a permutation is reported."""
    path = tmp_path / "twopath.pth"
    _two_path_checkpoint(path, record=False)
    model = TwoPath()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params[1:] + params[:1], lr=1e-2)  # embedding moved to the end
    with pytest.raises(ResumeError, match="CKF822") as err:
        ResumeGuard(model, opt).load(path)
    assert "only under a permutation" in str(err.value)
    assert "up.weight [8, 8] <- exp_avg [40, 8]" in str(err.value)


def test_without_names_same_shapes_in_custom_order_is_a_documented_limit(tmp_path):
    """Same shapes, an optimizer not in model order, no recorded names: nothing proves a swap;
    the report says the state was matched by position and checked by shape only."""
    path = tmp_path / "twopath.pth"
    _two_path_checkpoint(path, record=False)
    model = TwoPath()
    p = dict(model.named_parameters())
    order = ["embedding.weight", "down.weight", "down.bias", "up.weight", "up.bias", "head.weight",
             "head.bias"]
    opt = torch.optim.AdamW([p[n] for n in order], lr=1e-2)
    report = clean(ResumeGuard(model, opt).load, path)
    assert report.optimizer_matched_by == "position"
    assert any("matched by position and checked by shape only" in n for n in report.notes)


def test_optimizer_param_count_mismatch(tmp_path):
    path = tmp_path / "twopath.pth"
    _two_path_checkpoint(path, record=False)
    model = TwoPath()
    model.embedding.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with pytest.raises(ResumeError, match=r"CKF822 error: the checkpoint's optimizer has 7"):
        ResumeGuard(model, opt).load(path)


# ---------------------------------------------------------------------------------------------
# optimizer moments in the wrong dtype
# ---------------------------------------------------------------------------------------------


def _half_moments_checkpoint(path: Path, dtype: torch.dtype):
    run = train(new_run(V_NEW), STEPS)
    sd = run.optimizer.state_dict()
    sd["state"] = {i: {k: (v.to(dtype) if k != "step" else v) for k, v in s.items()}
                   for i, s in sd["state"].items()}
    torch.save({"model": run.model.state_dict(), "optimizer": sd,
                "scheduler": run.scheduler.state_dict(), "scaler": run.scaler.state_dict()}, path)


def test_fp16_moments_for_fp32_params_are_reported(tmp_path):
    path = tmp_path / "fp16_moments.pth"
    _half_moments_checkpoint(path, torch.float16)
    run = fresh_run()
    with pytest.raises(ResumeError, match="CKF823") as err:
        ResumeGuard(run.model, run.optimizer, run.scheduler, run.scaler, policy="remap").load(path)
    underflow = [p for p in err.value.problems if p.severity == "error"]
    assert underflow and "underflowed to 0" in underflow[0].message
    assert any(n.startswith("text_embedding.weight:exp_avg_sq") for n in underflow[0].params)
    low = [p for p in err.value.problems if "saved in 16 bits" in p.message]
    assert low and "text_embedding.weight:exp_avg (float16)" in low[0].params

    run = fresh_run()
    with pytest.warns(TrainingSetupWarning, match="CKF823"):
        report = ResumeGuard(run.model, run.optimizer, run.scheduler, run.scaler,
                             policy="fresh-optimizer", rewarm_steps=2).load(path)
    assert run.optimizer.state_dict()["state"] == {} and report.rewarm_steps == 2


def test_bf16_moments_load_cast_with_a_warning(tmp_path):
    path = tmp_path / "bf16_moments.pth"
    _half_moments_checkpoint(path, torch.bfloat16)
    run = fresh_run()
    with pytest.warns(TrainingSetupWarning, match="CKF823"):
        report = ResumeGuard(run.model, run.optimizer, run.scheduler, run.scaler).load(path)
    assert [(p.code, p.severity) for p in report.problems] == [("CKF823", "warning")]
    state = run.optimizer.state[run.model.text_embedding.weight]
    assert state["exp_avg"].dtype == torch.float32  # cast by optimizer.load_state_dict
    clean(guarded_steps, run, ResumeGuard(run.model, run.optimizer, probe_steps=0),
          make_batches(V_NEW, 2, seed=7))


def test_live_state_dtype_mismatch_is_reported(saved):
    run = fresh_run()
    sd = torch.load(saved["same"], map_location="cpu", weights_only=True)
    run.model.load_state_dict(sd["model"])
    run.optimizer.load_state_dict(sd["optimizer"])
    state = run.optimizer.state[run.model.text_head.weight]
    state["exp_avg"] = state["exp_avg"].half()
    with pytest.raises(ResumeError, match="CKF823") as err:
        ResumeGuard(run.model, run.optimizer).verify_loaded(saved["same"])
    assert err.value.problems[-1].params[0].startswith("text_head.weight:exp_avg (float16 on cpu")


# ---------------------------------------------------------------------------------------------
# `ckptfix repair --policy fresh` output: the guard re-warms by itself
# ---------------------------------------------------------------------------------------------


def test_repair_fresh_output_rewarms_automatically(saved, tmp_path):
    from ckptfix.surgery import repair

    tok = wordlevel_tokenizer(tmp_path / "tokenizer.json", V_NEW)
    out = tmp_path / "fixed.pth"
    result = repair(saved["old"], tok, out, policy="fresh")
    assert result.record["rewarm"] is True

    run = fresh_run()
    guard = ResumeGuard(run.model, run.optimizer, run.scheduler, run.scaler, tokenizer=tok,
                        rewarm_steps=4)  # policy "strict": the repaired file fits exactly
    report = clean(guard.load, out)
    assert report.problems == [] and report.rewarm_steps == 4
    assert report.record["policy"] == "fresh" and run.optimizer.state_dict()["state"] == {}
    assert report.extras == {"epoch": 1, "step": STEPS}
    base = run.optimizer.param_groups[0]["lr"]
    seen = record_lrs(run.optimizer)
    losses = clean(guarded_steps, run, guard, make_batches(V_NEW, 6, seed=7))
    assert seen == pytest.approx([base / 4, base / 2, 3 * base / 4, base, base, base])
    assert all(math.isfinite(x) for x in losses)


# ---------------------------------------------------------------------------------------------
# reading: safe, extras, wrappers, then the setup checks and the probe
# ---------------------------------------------------------------------------------------------


_EXECUTED: list[str] = []


def _payload() -> None:
    _EXECUTED.append("pwned")


class Evil:
    def __reduce__(self):
        return (_payload, ())


def test_load_never_unpickles_code_and_never_calls_torch_load(saved, tmp_path, monkeypatch):
    run = train(new_run(V_NEW), 2)
    path = tmp_path / "evil.pth"
    torch.save({"model": run.model.state_dict(), "hook": Evil()}, path)

    def no_torch_load(*args, **kwargs):
        raise AssertionError("ResumeGuard called torch.load")

    monkeypatch.setattr(torch, "load", no_torch_load)
    with pytest.raises(UnsafePickle, match="_payload"):
        ResumeGuard(fresh_run().model).load(path)
    assert _EXECUTED == []
    fresh = fresh_run()
    clean(ResumeGuard(fresh.model, fresh.optimizer, fresh.scheduler, fresh.scaler).load,
          saved["same"])


def test_extras_tensors_are_materialised(tmp_path):
    run = train(new_run(V_NEW), 2)
    rng = torch.get_rng_state()
    path = save_checkpoint(run, tmp_path / "extras.pth", best=torch.tensor(1.5),
                           history={"losses": [2.0, 1.0], "dtype": torch.bfloat16})
    torch.save({**torch.load(path, weights_only=True), "rng": rng}, path)
    other = fresh_run()
    report = clean(ResumeGuard(other.model, other.optimizer, other.scheduler, other.scaler).load, path)
    assert torch.equal(report.extras["rng"], rng)
    assert report.extras["best"].item() == 1.5
    assert report.extras["history"] == {"losses": [2.0, 1.0], "dtype": torch.bfloat16}
    data = json.loads(json.dumps(report.to_json()))
    assert data["extras"]["best"] == 1.5 and data["schema"] == "ckptfix.resume/1"


def test_ddp_prefix_and_missing_sections(tmp_path):
    run = train(new_run(V_NEW), 3)
    path = tmp_path / "ddp.pth"
    torch.save({"model": {f"module.{k}": v for k, v in run.model.state_dict().items()},
                "optimizer": run.optimizer.state_dict()}, path)
    other = fresh_run()
    with pytest.warns(TrainingSetupWarning, match="CKF827.*scheduler/scaler"):
        report = ResumeGuard(other.model, other.optimizer, other.scheduler, other.scaler).load(path)
    assert "stripped the 'module.' prefix from checkpoint keys" in report.actions
    assert torch.equal(other.model.norm.weight, run.model.norm.weight)


def test_missing_and_unexpected_keys(saved):
    class Bigger(TinyLM):
        def __init__(self):
            super().__init__(V_NEW)
            self.extra = nn.Linear(4, 4)

    model = Bigger()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ResumeError, match="CKF821") as err:
        ResumeGuard(model, opt, policy="remap").load(saved["same"])
    assert err.value.problems[0].params == ("extra.weight", "extra.bias")


def test_setup_checks_and_probe_run_after_load(saved):
    run = fresh_run()
    run.model.requires_grad_(False)  # e.g. a trainer re-froze everything
    with pytest.raises(TrainingSetupError, match="CKF801"):
        ResumeGuard(run.model, run.optimizer, run.scheduler, run.scaler).load(saved["same"])

    run = fresh_run()
    guard = ResumeGuard(run.model, run.optimizer, run.scheduler, run.scaler)
    clean(guard.load, saved["same"])
    ids = make_batches(V_NEW, 1, seed=7)[0]
    loss = lm_loss(run.model, ids).detach().requires_grad_()  # the graph is cut
    run.scaler.scale(loss).backward()
    with pytest.raises(TrainingSetupError, match="CKF810"):
        guard.before_step()


def test_policy_is_validated():
    with pytest.raises(ValueError, match="unknown policy"):
        ResumeGuard(nn.Linear(2, 2), policy="yolo")


def test_hf_trainer_folder_with_sorted_safetensors_keys(tmp_path):
    """safetensors sort their keys (layers.1, layers.10, layers.11, layers.2, ...): that order is
    not the registration order, so no names are inferred from it (no false CKF822)."""
    safetensors_torch = pytest.importorskip("safetensors.torch")

    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(12))

        def forward(self, x):
            for layer in self.layers:
                x = x + torch.tanh(layer(x))
            return x

    torch.manual_seed(0)
    model = Deep()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    safetensors_torch.save_file(model.state_dict(), str(folder / "model.safetensors"))
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 3}))

    live = Deep()
    live_opt = torch.optim.AdamW(live.parameters(), lr=1e-2)
    report = clean(ResumeGuard(live, live_opt).load, folder)
    assert report.format == "hf-trainer" and report.problems == []
    assert report.optimizer_matched_by == "position"
    assert report.extras["trainer_state"] == {"global_step": 3}
    for p, q in zip(model.parameters(), live.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg"], live_opt.state[q]["exp_avg"])
