"""`ckptfix inspect` findings, one test per code, on checkpoints made by real training code.

Every checkpoint here is written by a real loop (tests/ckpt_factory.py): AdamW steps, LambdaLR, a
GradScaler("cpu") driving the steps, torch.save. Each test reproduces the situation a user reported
(or the bug that produces it) and asserts the exact findings: code, severity, message, tensors, fix,
and that the text output, the `--json` output and the exit code agree. Where a finding claims what
PyTorch will do, the test does it and checks PyTorch really does.

CKF701-703 (archive integrity) are covered by the security tests.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from ckpt_factory import TinyLM, lm_loss, make_batches, new_run, save_checkpoint, train, warmup_lambda
from tokenizer_factory import train_bpe_tokenizer_json, train_sentencepiece
from torch import nn

import ckptfix
from ckptfix.cli import main

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"

pytestmark = [pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad"),
              pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")]



# --------------------------------------------------------------------------------------------- helpers


def cli(capsys, *args) -> tuple[int, str, str]:
    """Run `ckptfix ARGS` in-process; (exit code, stdout, stderr)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def inspect_cli(capsys, ckpt, tokenizer=None, *flags) -> tuple[int, str, dict]:
    """Run inspect twice (text, --json); check both agree; return (exit code, text, json)."""
    args = ["inspect", ckpt, *(["--tokenizer", tokenizer] if tokenizer else []), *flags]
    code, text, err = cli(capsys, *args)
    code_json, out, err_json = cli(capsys, *args, "--json")
    assert err == err_json == ""
    assert code == code_json
    data = json.loads(out)
    assert_text_matches_json(text, data)
    assert code == (1 if data["summary"]["error"] else 0)
    return code, text, data


def assert_text_matches_json(text: str, data: dict) -> None:
    """Every finding of the JSON is in the text report, with the same words, in the same order."""
    lines = text.splitlines()
    assert lines[0] == f"{data['path']}  ({data['format']})"
    s = data["summary"]
    assert f"findings: {s['error']} error(s), {s['warning']} warning(s), {s['info']} info" in lines
    headers = [line for line in lines if re.match(r"^  (error|warning|info) +CKF\d{3}  ", line)]
    assert len(headers) == len(data["findings"])
    stripped = [line.strip() for line in lines]
    for f, header in zip(data["findings"], headers):
        assert header.split()[:2] == [f["severity"], f["code"]] and header.endswith(f"  {f['title']}")
        assert f["message"] in stripped
        if f["tensors"]:
            shown = ", ".join(f["tensors"][:6]) + (f" (+{len(f['tensors']) - 6} more)" if len(f["tensors"]) > 6 else "")
            assert f"tensors: {shown}" in stripped
        if f["pytorch"]:
            assert f"pytorch: {f['pytorch']}" in stripped
        if f["fix"]:
            assert f"fix:     {f['fix']}" in stripped


def codes(data: dict) -> list[str]:
    return [f["code"] for f in data["findings"]]


def one(data: dict, code: str) -> dict:
    found = [f for f in data["findings"] if f["code"] == code]
    assert len(found) == 1, codes(data)
    return found[0]


def fixed_path(ckpt: Path) -> str:
    return str(ckpt.with_name(ckpt.stem + ".fixed" + ckpt.suffix))


def step_loop(run, batches, *, nan_at=(), scheduler=True) -> None:
    """The usual AMP loop, written out: scale, backward, scaler.step, scaler.update, scheduler.step."""
    for i, ids in enumerate(batches):
        run.optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(run.model, ids)
        if i in nan_at:
            loss = loss * float("nan")  # a bad batch: inf/NaN loss, as fp16 overflow produces
        run.scaler.scale(loss).backward()
        run.scaler.step(run.optimizer)
        run.scaler.update()
        if scheduler:
            run.scheduler.step()
        run.step += 1


@pytest.fixture(scope="session")
def sp_tokenizers(tmp_path_factory):
    """Real sentencepiece models of a given size, trained once per size."""
    folder = tmp_path_factory.mktemp("sp")
    made: dict[int, Path] = {}

    def get(size: int) -> Path:
        if size not in made:
            made[size] = train_sentencepiece(folder, size, name=f"sp{size}", normalization_rule_name="identity")
        return made[size]

    return get


@pytest.fixture(scope="session")
def tok1000(sp_tokenizers) -> Path:
    return sp_tokenizers(1000)


# The fix's tail where the tokenizer the rows were trained with is not known (identity.ids_unchecked)
UNCHECKED = ("  (OLD_TOKENIZER: the tokenizer the checkpoint was trained with; leave --from-tokenizer out only if the "
             "new one kept its ids and appended tokens: rows are then kept by id)")


# ------------------------------------------------------------------------------------------- 1xx vocab


def test_ckf101_rows_below_tokenizer_with_added_tokens(tmp_path, capsys):
    """Tokens added to the tokenizer (add_tokens / add_special_tokens), model never resized."""
    tok = train_bpe_tokenizer_json(tmp_path, 300, added=["<tool>"], special=["<|user|>", "<|assistant|>"])
    ckpt = save_checkpoint(train(new_run(300, dim=8), 4), tmp_path / "ckpt.pth")
    code, text, data = inspect_cli(capsys, ckpt, tok)
    assert code == 1 and codes(data) == ["CKF101"]
    f = one(data, "CKF101")
    assert f["severity"] == "error"
    assert f["message"] == ("2 vocab tensor(s) have 300 rows but the tokenizer has 303 tokens (ids 300..302 have no row); "
                            "added tokens past the end include 300:'<tool>', 301:'<|user|>', 302:'<|assistant|>'")
    assert f["tensors"] == ["text_embedding.weight", "text_head.weight"]
    # The tokenizer the rows were trained with is not known: the fix names --from-tokenizer (issue 46)
    assert f["fix"] == f"ckptfix repair {ckpt} --tokenizer {tok} --from-tokenizer OLD_TOKENIZER -o {fixed_path(ckpt)}" + UNCHECKED
    assert "IndexError" in f["pytorch"]
    # The claim: the first id >= rows cannot be looked up.
    model = TinyLM(300, 8)
    model.load_state_dict(torch.load(ckpt)["model"])
    with pytest.raises(IndexError):
        model(torch.tensor([[300]]))
    assert data["vocab"]["tokenizer"]["size"] == 303 and data["vocab"]["tokenizer"]["base_size"] == 300


def test_ckf102_seed001_one_extra_row(tmp_path, capsys, tok1000):
    """The seed-001 report: checkpoint built for 24001 tokens (here 1001), tokenizer with 24000 (here 1000)."""
    run = train(new_run(1001, dim=8), 12)
    ckpt = save_checkpoint(run, tmp_path / "ckpt.pth", epoch=2)
    code, text, data = inspect_cli(capsys, ckpt, tok1000)
    assert code == 1 and codes(data) == ["CKF102"]
    f = one(data, "CKF102")
    assert f["severity"] == "error" and f["title"] == "vocab rows more than the tokenizer"
    assert f["message"] == ("2 vocab tensor(s) have 1001 rows but the tokenizer has 1000 tokens "
                            "(1 extra row(s), not padding to a multiple of 8..256)")
    assert f["tensors"] == ["text_embedding.weight", "text_head.weight"]
    fix = f"ckptfix repair {ckpt} --tokenizer {tok1000} --from-tokenizer OLD_TOKENIZER -o {tmp_path / 'ckpt.fixed.pth'}"
    assert f["fix"] == fix + UNCHECKED
    assert f"fix:     {fix}{UNCHECKED}" in text
    vocab = {t["name"]: t for t in data["vocab"]["tensors"]}
    assert vocab["text_embedding.weight"]["moments"] == {"exp_avg": [1001, 8], "exp_avg_sq": [1001, 8]}
    assert vocab["text_head.weight"]["role"] == "head" and vocab["text_head.weight"]["rows"] == 1001

    # What the finding says PyTorch does (measured, not the report's "optimizer updates wrong parameters"):
    sd = torch.load(ckpt)
    model = TinyLM(1000, 8)
    with pytest.raises(RuntimeError, match="size mismatch for text_embedding.weight"):
        model.load_state_dict(sd["model"], strict=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    opt.load_state_dict(sd["optimizer"])  # accepted silently
    lm_loss(model, make_batches(1000, 1)[0]).backward()
    with pytest.raises(RuntimeError, match=r"The size of tensor a \(1001\) must match the size of tensor b \(1000\)"):
        opt.step()


@pytest.mark.parametrize("tokens, rows, multiple", [(1001, 1008, 8), (1000, 1024, 32), (1030, 1088, 64), (1030, 1152, 128)])
def test_ckf103_padded_rows_are_info(tmp_path, capsys, sp_tokenizers, tokens, rows, multiple):
    tok = sp_tokenizers(tokens)
    ckpt = save_checkpoint(train(new_run(rows, dim=8), 3), tmp_path / "ckpt.pth")
    code, text, data = inspect_cli(capsys, ckpt, tok)
    assert code == 0 and codes(data) == ["CKF103"]
    f = one(data, "CKF103")
    assert f["severity"] == "info"
    assert f["message"] == (f"{rows} rows for {tokens} tokens: padded to a multiple of {multiple} "
                            f"({rows - tokens} unused row(s))")
    assert f["tensors"] == ["text_embedding.weight", "text_head.weight"]
    assert data["summary"] == {"error": 0, "warning": 0, "info": 1}


def test_ckf104_head_resized_separately(tmp_path, capsys, tok1000):
    """The head was replaced by a 1001-row one (one token added to the head only), training went on."""
    run = train(new_run(1000, dim=8), 4)
    head = nn.Linear(8, 1001, bias=False)
    with torch.no_grad():
        head.weight[:1000] = run.model.text_head.weight
    run.model.text_head = head
    run.optimizer = torch.optim.AdamW(run.model.parameters(), lr=3e-3, weight_decay=0.01)
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer, warmup_lambda(10))
    run.scaler, run.step = torch.amp.GradScaler("cpu"), 0
    train(run, 4, vocab=1000)
    ckpt = save_checkpoint(run, tmp_path / "ckpt.pth")

    code, text, data = inspect_cli(capsys, ckpt)
    assert code == 1 and codes(data) == ["CKF104"]
    f = one(data, "CKF104")
    assert f["severity"] == "error"
    assert f["message"] == "text_embedding.weight has 1000 rows but text_head.weight has 1001"
    assert f["tensors"] == ["text_embedding.weight", "text_head.weight"]
    assert f["fix"] == f"ckptfix repair {ckpt} --tokenizer NEW_TOKENIZER -o {fixed_path(ckpt)}"

    # With the 1000-token tokenizer the head's extra row is reported as well.
    code, _, data = inspect_cli(capsys, ckpt, tok1000)
    assert code == 1 and codes(data) == ["CKF102", "CKF104"]
    assert one(data, "CKF102")["tensors"] == ["text_head.weight"]


# --------------------------------------------------------------------------------------- 2xx optimizer


def test_ckf201_old_moments_loaded_into_resized_model(tmp_path, capsys, tok1000):
    """The 'shape-filtering' resume hack: load only the tensors whose shapes fit, then the OLD optimizer."""
    old = save_checkpoint(train(new_run(1001, dim=8), 6), tmp_path / "old.pth")
    sd = torch.load(old)
    torch.manual_seed(0)
    model = TinyLM(1000, 8)
    own = model.state_dict()
    model.load_state_dict({k: v for k, v in sd["model"].items() if v.shape == own[k].shape}, strict=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    opt.load_state_dict(sd["optimizer"])  # PyTorch accepts the 1001-row moments without a word
    ckpt = tmp_path / "ckpt.pth"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1, "step": 6}, ckpt)

    code, text, data = inspect_cli(capsys, ckpt, tok1000)
    assert code == 1 and codes(data) == ["CKF201", "CKF318"]  # CKF318: the run's LambdaLR state was not saved
    f = one(data, "CKF201")
    assert f["severity"] == "error"
    assert f["message"] == ("4 moment tensor(s) do not match their parameter, e.g. exp_avg of text_embedding.weight "
                            "is [1001, 8] but the parameter is [1000, 8]")
    assert f["tensors"] == ["text_embedding.weight", "text_head.weight"]
    assert f["fix"] == f"ckptfix repair {ckpt} --tokenizer {tok1000} -o {fixed_path(ckpt)} --policy remap"
    assert data["optimizer"]["mapping"] == "position"
    # ... and the first step fails exactly as the finding says.
    lm_loss(model, make_batches(1000, 1)[0]).backward()
    with pytest.raises(RuntimeError, match="The size of tensor a .* must match the size of tensor b"):
        opt.step()


def test_ckf202_optimizer_holds_parameters_the_model_does_not_save(tmp_path, capsys):
    """An auxiliary head trained by the same optimizer but not part of model.state_dict()."""
    run = new_run(1000, dim=8)
    aux = nn.Linear(8, 3)
    run.optimizer = torch.optim.AdamW([*run.model.parameters(), *aux.parameters()], lr=3e-3, weight_decay=0.01)
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer, warmup_lambda(10))
    for ids in make_batches(1000, 4):
        run.optimizer.zero_grad()
        loss = lm_loss(run.model, ids) + aux(run.model.embedding(ids)).pow(2).mean()
        loss.backward()
        run.optimizer.step()
        run.scheduler.step()
        run.step += 1
    ckpt = save_checkpoint(run, tmp_path / "ckpt.pth")

    code, text, data = inspect_cli(capsys, ckpt)
    assert code == 1 and codes(data) == ["CKF202", "CKF204"]
    f = one(data, "CKF202")
    assert f["severity"] == "error" and f["tensors"] == []
    assert f["message"] == ("the optimizer's param groups hold 18 parameters but the model has 16 floating-point "
                            "parameter tensors")
    assert f["fix"] == f"ckptfix repair {ckpt} --tokenizer NEW_TOKENIZER -o {fixed_path(ckpt)} --policy fresh"
    weak = one(data, "CKF204")
    assert weak["severity"] == "info" and weak["message"].endswith("(method: shape)")
    # The claim: loading into the model's own optimizer fails.
    model = TinyLM(1000, 8)
    with pytest.raises(ValueError, match="doesn't match the size of optimizer's group"):
        torch.optim.AdamW(model.parameters()).load_state_dict(torch.load(ckpt)["optimizer"])


def test_ckf203_parameter_frozen_then_unfrozen(tmp_path, capsys):
    run = new_run(1000, dim=8)
    run.model.text_embedding.weight.requires_grad_(False)  # frozen for the first 5 steps
    train(run, 5)
    run.model.text_embedding.weight.requires_grad_(True)
    train(run, 10, seed=2)
    ckpt = save_checkpoint(run, tmp_path / "ckpt.pth")

    code, text, data = inspect_cli(capsys, ckpt)
    assert code == 0 and codes(data) == ["CKF203"]
    f = one(data, "CKF203")
    assert f["severity"] == "warning"
    assert f["message"] == "step is 15 for most parameters but differs for 1 (values: 10, 15)"
    assert f["tensors"] == ["text_embedding.weight"]
    assert data["optimizer"]["step"] == [10.0, 15.0]


# ------------------------------------------------------------------------------------- 3xx schedule/LR


def test_ckf301_scheduler_stepped_per_epoch(tmp_path, capsys):
    run = new_run(1000, dim=8)
    batches = make_batches(1000, 20)
    for epoch in range(2):
        step_loop(run, batches[epoch * 10:(epoch + 1) * 10], scheduler=False)
        run.scheduler.step()  # once per epoch, but the lambda counts optimizer steps
    ckpt = save_checkpoint(run, tmp_path / "ckpt.pth", epoch=2)
    code, text, data = inspect_cli(capsys, ckpt)
    assert code == 0 and codes(data) == ["CKF301"]
    f = one(data, "CKF301")
    assert f["severity"] == "warning" and f["tensors"] == []
    assert f["message"] == "scheduler last_epoch=2 but the optimizer has taken 20 steps"
    assert f["fix"] == "Check the scheduler is stepped once per optimizer step; `--policy reset` restarts the schedule."


def test_ckf301_scheduler_stepped_twice_per_step(tmp_path, capsys):
    run = new_run(1000, dim=8)
    for ids in make_batches(1000, 25):
        step_loop(run, [ids])
        run.scheduler.step()  # a second call (e.g. in a logging hook)
    ckpt = save_checkpoint(run, tmp_path / "ckpt.pth")
    code, _, data = inspect_cli(capsys, ckpt)
    assert codes(data) == ["CKF301"]
    assert one(data, "CKF301")["message"] == "scheduler last_epoch=50 but the optimizer has taken 25 steps"
    assert one(data, "CKF301")["severity"] == "warning"


def test_ckf301_gradscaler_skipped_steps_is_info(tmp_path, capsys):
    """Two NaN losses: GradScaler skips optimizer.step twice, the loop still steps the scheduler."""
    run = new_run(1000, dim=8)
    step_loop(run, make_batches(1000, 12), nan_at=(4, 7))
    assert run.scaler.get_scale() == 65536.0 / 4
    ckpt = save_checkpoint(run, tmp_path / "ckpt.pth")
    code, _, data = inspect_cli(capsys, ckpt)
    assert code == 0 and codes(data) == ["CKF301"]
    f = one(data, "CKF301")
    assert f["severity"] == "info"
    assert f["message"] == ("scheduler last_epoch=12, optimizer step=10: 2 more scheduler steps, consistent with "
                            "GradScaler skipping steps on inf/NaN gradients")
    assert data["scaler"]["scale"] == 16384.0


def test_ckf302_lambda_returns_zero_after_the_schedule_started(tmp_path, capsys):
    run = new_run(1000, dim=8)
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer, lambda s: 1.0 if s < 8 else 0.0)
    train(run, 12)
    ckpt = save_checkpoint(run, tmp_path / "ckpt.pth")
    code, _, data = inspect_cli(capsys, ckpt)
    assert code == 1 and codes(data) == ["CKF302"]
    f = one(data, "CKF302")
    assert f["severity"] == "error" and f["message"] == "param group(s) [0] have lr=0 at scheduler step 12"
    assert data["optimizer"]["param_groups"][0]["lr"] == 0.0 and data["scheduler"]["last_lr"] == [0.0]


def test_ckf302_warmup_from_zero_at_step_0_is_info(tmp_path, capsys):
    run = new_run(1000, dim=8)
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer, lambda s: s / 10)  # lr 0 at step 0
    ckpt = save_checkpoint(run, tmp_path / "ckpt.pth", epoch=0)  # a checkpoint-0 saved before training
    code, _, data = inspect_cli(capsys, ckpt)
    assert code == 0 and codes(data) == ["CKF302"]
    f = one(data, "CKF302")
    assert f["severity"] == "info"
    assert f["message"] == "param group(s) [0] have lr=0 at the first schedule step (warmup from 0)"


# ------------------------------------------------------------------------------------------ 4xx scaler


def _nan_every_step(init_scale: float, backoff: float, steps: int):
    run = new_run(1000, dim=8)
    run.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, backoff_factor=backoff)
    step_loop(run, make_batches(1000, steps), nan_at=range(steps))
    return run


def test_ckf401_scale_collapsed_by_nan_every_step(tmp_path, capsys):
    run = _nan_every_step(1.0, 1e-3, 4)  # 1 -> 1e-3 -> 1e-6 -> 1e-9 -> 1e-12
    ckpt = save_checkpoint(run, tmp_path / "ckpt.pth")
    code, _, data = inspect_cli(capsys, ckpt)
    assert code == 1 and codes(data) == ["CKF401"]
    f = one(data, "CKF401")
    assert f["severity"] == "error"
    assert f["message"] == "GradScaler scale is 1e-12 (below fp16's smallest subnormal 2^-24)"
    assert f["fix"] == (f"ckptfix repair {ckpt} --tokenizer NEW_TOKENIZER -o {fixed_path(ckpt)}  "
                        "(repair resets a collapsed scale to 65536)")
    assert data["optimizer"]["params_with_state"] == 0  # every step was skipped


def test_ckf401_scale_below_one_is_a_warning(tmp_path, capsys):
    run = _nan_every_step(1.0, 0.5, 1)
    ckpt = save_checkpoint(run, tmp_path / "ckpt.pth")
    code, _, data = inspect_cli(capsys, ckpt)
    assert code == 0 and codes(data) == ["CKF401"]
    f = one(data, "CKF401")
    assert f["severity"] == "warning" and f["message"] == "GradScaler scale is 0.5 (< 1): it has backed off many times"


def test_ckf401_non_finite_scale_never_recovers(tmp_path, capsys):
    run = new_run(1000, dim=8)
    run.scaler = torch.amp.GradScaler("cpu", init_scale=float("inf"))
    step_loop(run, make_batches(1000, 3))
    assert run.scaler.get_scale() == float("inf")  # backoff of inf is inf: every step skipped
    ckpt = save_checkpoint(run, tmp_path / "ckpt.pth")
    code, _, data = inspect_cli(capsys, ckpt)
    assert code == 1 and codes(data) == ["CKF401"]
    f = one(data, "CKF401")
    assert f["severity"] == "error" and f["message"] == "GradScaler scale is inf"
    assert data["scaler"]["scale"] == "inf"


def test_ckf402_fp16_parameters_with_gradscaler(tmp_path, capsys):
    """The seed-000 'fix': the model cast to float16, the GradScaler kept."""
    run = new_run(1000, dim=8)
    run.model.half()
    run.optimizer = torch.optim.AdamW(run.model.parameters(), lr=3e-3)
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer, warmup_lambda(10))
    run.scaler.scale(lm_loss(run.model, make_batches(1000, 1)[0])).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):  # what the finding says
        run.scaler.step(run.optimizer)
    ckpt = save_checkpoint(run, tmp_path / "ckpt.pth")

    code, _, data = inspect_cli(capsys, ckpt)
    assert code == 1 and codes(data) == ["CKF402"]
    f = one(data, "CKF402")
    names = list(run.model.state_dict())
    assert f["severity"] == "error"
    assert f["message"] == "16 float16 parameter tensor(s) alongside GradScaler state (e.g. text_embedding.weight)"
    assert f["tensors"] == names
    assert data["model"]["dtypes"] == {"float16": 16}


# ---------------------------------------------------------------------------------------- 5xx numerics


def test_ckf501_ckf502_nan_after_a_poisoned_step_only_with_scan(tmp_path, capsys):
    """No GradScaler: one step whose embedding gradient has a NaN row poisons that row and its moments."""
    run = new_run(1000, dim=8)
    for i, ids in enumerate(make_batches(1000, 6)):
        run.optimizer.zero_grad()
        lm_loss(run.model, ids).backward()
        if i == 5:
            run.model.text_embedding.weight.grad[5] = float("nan")
        run.optimizer.step()
        run.scheduler.step()
        run.step += 1
    ckpt = save_checkpoint(run, tmp_path / "ckpt.pth")

    code, _, data = inspect_cli(capsys, ckpt)
    assert code == 0 and codes(data) == []  # without --scan no tensor bytes are read

    code, text, data = inspect_cli(capsys, ckpt, None, "--scan")
    assert code == 1 and codes(data) == ["CKF501", "CKF502"]
    weights, moments = one(data, "CKF501"), one(data, "CKF502")
    assert weights["severity"] == moments["severity"] == "error"
    assert weights["message"] == "1 weight tensor(s) hold NaN/Inf values: text_embedding.weight (8)"
    assert weights["tensors"] == ["text_embedding.weight"]
    assert weights["fix"] == "Resume from an earlier checkpoint saved before the divergence."
    assert moments["message"] == ("2 moment tensor(s) hold NaN/Inf values: text_embedding.weight:exp_avg (8), "
                                  "text_embedding.weight:exp_avg_sq (8)")
    assert moments["tensors"] == ["text_embedding.weight:exp_avg", "text_embedding.weight:exp_avg_sq"]
    assert moments["fix"] == f"ckptfix repair {ckpt} --tokenizer NEW_TOKENIZER -o {fixed_path(ckpt)} --policy fresh"


def test_ckf501_counts_exactly_in_tensors_larger_than_one_read_chunk(tmp_path, capsys):
    """--scan reads in chunks of 4M elements; the count is per element, whatever the chunking."""
    from ckptfix.checks.numerics import CHUNK

    weight = torch.zeros(CHUNK + 1000)
    weight[[5, CHUNK + 6, CHUNK + 999]] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    torch.save({"model": {"big.weight": weight, "ok.weight": torch.zeros(CHUNK + 8)}}, tmp_path / "ckpt.pth")
    code, _, data = inspect_cli(capsys, tmp_path / "ckpt.pth", None, "--scan")
    assert code == 1 and codes(data) == ["CKF501"]
    assert one(data, "CKF501")["message"] == "1 weight tensor(s) hold NaN/Inf values: big.weight (3)"
    assert one(data, "CKF501")["tensors"] == ["big.weight"]


# ---------------------------------------------------------------------------------------- 6xx adapters


class ZeroInitLoRA(nn.Module):
    """A hand-rolled LoRA wrapper (no peft), named like peft's: lora_A.default / lora_B.default."""

    def __init__(self, base: nn.Linear, r: int = 2):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base.out_features, bias=False)})
        nn.init.zeros_(self.lora_B["default"].weight)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


def test_ckf601_plain_lora_modules_never_trained(tmp_path, capsys):
    torch.manual_seed(0)
    model = TinyLM(1000, 8)
    for block in model.blocks:
        block[1] = ZeroInitLoRA(block[1])
    model.requires_grad_(False)  # the bug: adapters frozen along with the base
    ckpt = tmp_path / "ckpt.pth"
    torch.save({"model": model.state_dict()}, ckpt)
    code, _, data = inspect_cli(capsys, ckpt)
    assert code == 1 and codes(data) == ["CKF601"]
    f = one(data, "CKF601")
    assert f["severity"] == "error"
    assert f["message"] == "all 2 lora_B tensors are exactly zero: the adapter never trained"
    assert f["tensors"] == ["blocks.0.1.lora_B.default.weight", "blocks.1.1.lora_B.default.weight"]


@pytest.mark.peft
def test_ckf601_peft_adapter_saved_before_training(tmp_path, capsys):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(TinyLM(1000, 8), peft.LoraConfig(r=4, target_modules=["blocks.0.1", "blocks.1.1"]))
    torch.save({"model": model.state_dict()}, tmp_path / "ckpt.pth")
    model.save_pretrained(tmp_path / "adapter")

    code, _, data = inspect_cli(capsys, tmp_path / "ckpt.pth")
    assert code == 1 and codes(data) == ["CKF601"]
    assert one(data, "CKF601")["tensors"] == ["base_model.model.blocks.0.1.lora_B.default.weight",
                                              "base_model.model.blocks.1.1.lora_B.default.weight"]
    code, _, data = inspect_cli(capsys, tmp_path / "adapter")
    assert code == 1 and data["format"] == "peft-adapter" and codes(data) == ["CKF601"]
    f = one(data, "CKF601")
    assert f["message"] == "all 2 lora_B tensors are exactly zero: the adapter never trained"
    assert f["tensors"] == ["base_model.model.blocks.0.1.lora_B.weight", "base_model.model.blocks.1.1.lora_B.weight"]


@pytest.mark.peft
def test_ckf601_some_adapters_left_out_of_the_optimizer_is_a_warning(tmp_path, capsys):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(TinyLM(1000, 8), peft.LoraConfig(r=4, target_modules=["blocks.0.1", "blocks.1.1"]))
    # The bug: param groups built by a name filter that only matches the first block's adapters.
    opt = torch.optim.AdamW([p for n, p in model.named_parameters() if "blocks.0.1.lora" in n], lr=1e-2)
    for ids in make_batches(1000, 3):
        opt.zero_grad()
        lm_loss(model, ids).backward()
        opt.step()
    torch.save({"model": model.state_dict()}, tmp_path / "ckpt.pth")
    code, _, data = inspect_cli(capsys, tmp_path / "ckpt.pth")
    assert code == 0 and codes(data) == ["CKF601"]
    f = one(data, "CKF601")
    assert f["severity"] == "warning" and f["message"] == "1 of 2 lora_B tensors are exactly zero"
    assert f["tensors"] == ["base_model.model.blocks.1.1.lora_B.default.weight"]


# ------------------------------------------------------------------------------------ committed fixtures


def _fixture(name: str) -> Path:
    path = FIXTURES / name / "ckpt.pth"
    if not path.exists():
        pytest.skip(f"{path} missing: run python fixtures/make_fixtures.py")
    return path


@pytest.mark.parametrize("name, exit_code, expected", [
    ("seed001", 1, ["CKF102"]), ("padded", 0, ["CKF103"]), ("clean", 0, []), ("tied", 0, []),
    ("tokenizer", 1, ["CKF101"]),
])
def test_committed_fixtures(capsys, monkeypatch, name, exit_code, expected):
    _fixture(name)
    monkeypatch.chdir(REPO)  # the README's commands use paths relative to the repository
    tok = f"fixtures/{name}/" + ("tokenizer.json" if name == "tokenizer" else "tokenizer.model")
    code, text, data = inspect_cli(capsys, f"fixtures/{name}/ckpt.pth", tok)
    assert code == exit_code and codes(data) == expected
    if name == "seed001":
        f = one(data, "CKF102")
        assert f["message"].startswith("2 vocab tensor(s) have 1001 rows but the tokenizer has 1000 tokens")
        assert f["fix"] == ("ckptfix repair fixtures/seed001/ckpt.pth --tokenizer fixtures/seed001/tokenizer.model "
                            "--from-tokenizer OLD_TOKENIZER -o fixtures/seed001/ckpt.fixed.pth" + UNCHECKED)
        assert data["extras"] == {"epoch": 2, "step": 48, "batch": 24, "learning_rate": 0.003}
        assert data["optimizer"]["step"] == 48 and data["scheduler"]["last_epoch"] == 48
    if name == "tied":
        assert data["model"]["tied"] == {"lm_head.weight": "wte.weight"}
        head = next(t for t in data["vocab"]["tensors"] if t["name"] == "lm_head.weight")
        assert head["tied_to"] == "wte.weight" and head["moments"] == {"exp_avg": [1000, 8], "exp_avg_sq": [1000, 8]}


def test_fixtures_regenerate_identically(tmp_path):
    """`python fixtures/make_fixtures.py` rebuilds the committed files: same tokenizers, same tensors."""
    _fixture("seed001")
    import importlib.util

    import ckptfix

    out = tmp_path / "fixtures"
    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
    make_fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_fixtures)
    make_fixtures.main(["--out", str(out)])

    for name in ("seed001", "padded", "clean", "tied", "tokenizer"):
        for tok in ("tokenizer.model", "tokenizer.json"):
            if (FIXTURES / name / tok).exists():
                assert (out / name / tok).read_bytes() == (FIXTURES / name / tok).read_bytes(), f"{name}/{tok}"
        new, old = torch.load(out / name / "ckpt.pth"), torch.load(FIXTURES / name / "ckpt.pth")
        for key in ("model",):
            assert new[key].keys() == old[key].keys()
            for k in old[key]:
                torch.testing.assert_close(new[key][k], old[key][k], rtol=1e-5, atol=1e-6)
        a, b = ckptfix.inspect(out / name / "ckpt.pth").to_json(), ckptfix.inspect(FIXTURES / name / "ckpt.pth").to_json()
        for d in (a, b):
            d.pop("path")
            for f in d["findings"]:
                f.pop("fix")
        assert a == b, name


def test_a_tokenizer_compared_with_no_vocab_tensor_is_said(tmp_path):
    """A tokenizer given, but no tensor recognised as the vocabulary's (Molmo2's embedding, which transformers 5
    saves split in two tensors): before, the report had no vocab line and no finding, as if all were clear."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    torch.save({"model": model.state_dict(), "config": {"vocab_size": 40}}, tmp_path / "ckpt.pth")
    tok = train_bpe_tokenizer_json(tmp_path, 60, name="tok.json")
    report = ckptfix.inspect(str(tmp_path / "ckpt.pth"), tokenizer=str(tok))
    (found,) = [f for f in report.findings if f.code == "CKF109"]
    assert found.severity == "warning" and "compared with nothing" in found.message and "40" in found.message
    assert "CKF109" not in {f.code for f in ckptfix.inspect(str(tmp_path / "ckpt.pth")).findings}
    assert "CKF113" in {f.code for f in report.findings}  # 60 tokens, the config's 40: ids 40..59 have no row
    small = train_bpe_tokenizer_json(tmp_path, 30, name="small.json")
    assert "CKF113" not in {f.code for f in ckptfix.inspect(str(tmp_path / "ckpt.pth"), tokenizer=str(small)).findings}
