"""Issue 33, items 2 and 5, on a real Hugging Face Trainer run (untied GPT-2, 512 rows, then a tokenizer of
519): inspect's fix names the whole `checkpoint-N/` folder even when given its `model.safetensors`, and
suggests an output beside the run's output_dir (never `checkpoint-N-fixed` inside it, which the Trainer's
rotation counts as step N); repair ends with how to resume; both ways it names resume; and the healthy
folder's optimizer mapping is reported without a false alarm (CKF204)."""

from __future__ import annotations

import os
import shlex

import pytest
import torch

import ckptfix
from ckptfix.cli import main as cli_main
from ckptfix.resume_hints import resume_lines, suggested_output

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.transformers


def _trainer(tmp_path, vocab_or_model, out, steps, tok=None):
    model = vocab_or_model
    if isinstance(model, int):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=vocab_or_model, n_positions=32, tie_word_embeddings=False))
    ids = torch.randint(0, 512, (16, 12), generator=torch.Generator().manual_seed(0))
    args = transformers.TrainingArguments(output_dir=str(out), max_steps=steps, save_steps=3, report_to=[],
                                          use_cpu=True, per_device_train_batch_size=4, disable_tqdm=True)
    return transformers.Trainer(model=model, args=args, processing_class=tok,
                                train_dataset=[{"input_ids": r, "labels": r} for r in ids])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from tokenizer_factory import make_hf_tokenizer_folder

    root = tmp_path_factory.mktemp("hfrun")
    _trainer(root, 512, root / "out", 3).train()
    tok = make_hf_tokenizer_folder(root, 512, added=[f"<new{i}>" for i in range(7)], name="tok")
    return root, tok


def test_fix_names_the_folder_and_an_output_beside_the_run(run, monkeypatch, capsys):
    root, tok = run
    monkeypatch.chdir(root)
    expected = "ckptfix repair out/checkpoint-3 --tokenizer tok -o out-checkpoint-3-fixed"
    # the folder holds no tokenizer, so the fix names --from-tokenizer OLD_TOKENIZER (issue 46); this tokenizer
    # appended its 7 tokens to the ids the run trained, so the fix is pasted without it, as its tail says
    unchecked = expected.replace(" -o ", " --from-tokenizer OLD_TOKENIZER -o ")
    for given in ("out/checkpoint-3", "out/checkpoint-3/model.safetensors"):
        (ckf,) = [f for f in ckptfix.inspect(given, "tok").findings if f.code == "CKF101"]
        assert ckf.fix.startswith(unchecked + "  (OLD_TOKENIZER: ") and "leave --from-tokenizer out" in ckf.fix, given
    cli_main(shlex.split(expected)[1:])  # the fix, pasted (returns: exit code 0)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2:] == [
        "wrote out-checkpoint-3-fixed",
        "resume     build the model from out-checkpoint-3-fixed (AutoModelForCausalLM.from_pretrained: its "
        "config.json says vocab_size 519), or call model.resize_token_embeddings(len(tokenizer)) before creating "
        "the Trainer; then trainer.train(resume_from_checkpoint='out-checkpoint-3-fixed') with the new tokenizer "
        "as processing_class (the model code of the old run gives 'size mismatch')"]
    assert sorted(os.listdir(root / "out")) == ["checkpoint-3"]  # nothing the Trainer's rotation would count

    # Both ways the resume line names work with the Trainer's own loader.
    hf_tok = transformers.AutoTokenizer.from_pretrained(root / "tok")
    built = transformers.GPT2LMHeadModel.from_pretrained(root / "out-checkpoint-3-fixed")
    t = _trainer(root, built, root / "resumed", 6, hf_tok)
    t.train(resume_from_checkpoint=str(root / "out-checkpoint-3-fixed"))
    assert t.state.global_step == 6
    torch.manual_seed(0)
    old_code = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=512, n_positions=32, tie_word_embeddings=False))
    old_code.resize_token_embeddings(len(hf_tok))
    t = _trainer(root, old_code, root / "resumed2", 6, hf_tok)
    t.train(resume_from_checkpoint=str(root / "out-checkpoint-3-fixed"))
    assert t.state.global_step == 6


def test_healthy_trainer_folder_gets_no_false_mapping_alarm(run):
    root, _ = run
    report = ckptfix.inspect(root / "out" / "checkpoint-3")
    assert report.exit_code == 0
    (ckf204,) = [f for f in report.findings if f.code == "CKF204"]
    assert ckf204.severity == "info"
    assert ckf204.message == (
        "the optimizer's 29 entries follow the model class's parameter order, which the weights file does not "
        "record (safetensors stores names sorted): ckptfix names 0 of them (unique shapes); taken together their "
        "shapes are exactly the model's parameters' shapes")
    assert "matched to parameters (method" not in ckf204.message


def test_suggested_outputs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("checkpoint-30", "checkpoint_7", "step-100"):
        (tmp_path / "run" / name).mkdir(parents=True)
    assert suggested_output("run/checkpoint-30") == "run-checkpoint-30-fixed"
    assert suggested_output("run/checkpoint_7/") == "run-checkpoint_7-fixed"  # accelerate's automatic naming
    assert suggested_output(str(tmp_path / "run" / "checkpoint-30")) == str(tmp_path / "run-checkpoint-30-fixed")
    assert suggested_output("run/step-100") == "run/step-100-fixed"  # no framework counts it
    assert suggested_output("run/last.ckpt") == "run/last.fixed.ckpt"


@pytest.mark.parametrize("fmt, needle", [
    ("hf-trainer", "trainer.train(resume_from_checkpoint='OUT')"),
    ("hf-model", "from_pretrained('OUT')"),
    ("peft-adapter", "PeftModel.from_pretrained(base, 'OUT')"),
    ("lightning", "trainer.fit(model, ckpt_path='OUT')"),
    ("accelerate", "accelerator.load_state('OUT')"),
    ("dcp", "dcp.load(state_dict, checkpoint_id='OUT')"),
    ("deepspeed-universal", "engine.load_checkpoint('.', tag='OUT')"),
    ("torch", "torch.load('OUT', weights_only=True)"),
])
def test_every_format_says_how_to_resume(fmt, needle):
    lines = resume_lines(fmt, "OUT", 1024, 1003)
    assert len(lines) == 1 and needle in lines[0], lines
    if fmt not in ("hf-trainer", "hf-model", "peft-adapter"):
        assert "build the model with 1024 vocab rows (1003 tokens + 21 padding)" in lines[0]


def test_a_url_out_is_named_as_its_local_copy_where_the_loader_reads_local_paths():
    """from_pretrained, load_file and torch.load take local paths: for an OUT in object storage the hint says to
    copy it down first and names the copy; Lightning's ckpt_path and DCP (FsspecReader) take the URL itself."""
    from ckptfix.resume_hints import resume_lines

    lines = resume_lines("hf-model", "s3://b/run/step-fixed", 1088, 1088)
    assert lines[0].startswith("copy s3://b/run/step-fixed to a local step-fixed first")
    assert "from_pretrained('step-fixed')" in lines[1] and "s3://" not in lines[1]
    assert "ckpt_path='s3://b/run/x.ckpt'" in resume_lines("lightning", "s3://b/run/x.ckpt", 64, 64)[0]
    assert "checkpoint_id='s3://b/run/step'" in resume_lines("dcp", "s3://b/run/step", 64, 64)[0]


def test_an_output_inside_the_trainer_output_dir_gets_a_note(run, tmp_path, monkeypatch, capsys):
    """Issue 46: `repair -o` into the run's output_dir under a name the Trainer reads as a step: one line on stderr
    (README: beside the run's output_dir, not inside), true of transformers' own rotation and resume."""
    import shutil

    from transformers.trainer_utils import get_last_checkpoint, sort_checkpoints

    root, tok = run
    shutil.copytree(root / "out", tmp_path / "out")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert cli_main(["repair", "out/checkpoint-3", "-t", str(tok), "-o", "out/checkpoint-3-fixed", "-q"]) in (0, None)
    assert capsys.readouterr().err.splitlines() == [
        "ckptfix: note: out/checkpoint-3-fixed is inside the Trainer output_dir out (beside checkpoint-3): the "
        "Trainer's rotation (save_total_limit) counts it as step 3 and may delete it; write it beside the output_dir "
        "instead (-o out-checkpoint-3-fixed)"]
    assert os.path.join("out", "checkpoint-3-fixed") in sort_checkpoints("out")  # rotation counts it
    assert cli_main(["repair", "out/checkpoint-3", "-t", str(tok), "-o", "out/checkpoint-9", "-q"]) in (0, None)
    assert capsys.readouterr().err.splitlines() == [
        "ckptfix: note: out/checkpoint-9 is inside the Trainer output_dir out (beside checkpoint-3): the Trainer's "
        "resume_from_checkpoint=True takes it when 9 is the highest step there, and its rotation (save_total_limit) "
        "counts it as step 9 and may delete it; write it beside the output_dir instead (-o out-checkpoint-9)"]
    assert get_last_checkpoint("out") == os.path.join("out", "checkpoint-9")  # what resume_from_checkpoint=True takes
    for harmless in ("out-checkpoint-3-fixed", "out/fixed"):  # beside the run; a name the Trainer does not read
        assert cli_main(["repair", "out/checkpoint-3", "-t", str(tok), "-o", harmless, "-q"]) in (0, None)
        assert "note" not in capsys.readouterr().err
