"""Verify (ckptfix/verify.py): a correct repaired output matches its plan; each way of breaking it is caught.

Mutations of a real repaired file (TinyLM after real AdamW steps, repaired by ckptfix): a recorded vocab size
left at the old value, a state tensor left at the old rows, a tensor the plan does not list changed. And end
to end: a writer that leaves the config unwritten makes repair remove OUT and exit 3.
"""

from __future__ import annotations

import pytest
import torch
from ckpt_factory import new_run, save_checkpoint, train
from tokenizer_factory import train_sentencepiece

import ckptfix
from ckptfix.cli import main
from ckptfix.formats import read_checkpoint
from ckptfix.verify import VerifyFailed, differences

OLD, NEW = 301, 311


@pytest.fixture(scope="module")
def repaired(tmp_path_factory):
    folder = tmp_path_factory.mktemp("verify")
    run = train(new_run(OLD), 6)
    src = save_checkpoint(run, folder / "src.pth", config={"vocab_size": OLD, "n_layer": 2})
    tok = train_sentencepiece(folder, NEW, name="sp")
    out = folder / "fixed.pth"
    result = ckptfix.repair(src, tok, out)
    return src, tok, out, result.plan


def _mutated(out, tmp_path, change) -> str:
    sd = torch.load(out, weights_only=True)
    change(sd)
    path = tmp_path / "mutated.pth"
    torch.save(sd, path)
    return str(path)


def test_the_repaired_output_matches_its_plan(repaired):
    _, _, out, plan = repaired
    assert differences(plan, read_checkpoint(str(out))) == []
    assert plan.recorded == {("config", "vocab_size"): NEW}


def _set(sd, *path_value):
    *path, value = path_value
    node = sd
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


MUTATIONS = {
    "config-value-left": (lambda sd, old: _set(sd, "config", "vocab_size", OLD), "recorded config.vocab_size is 301"),
    "state-left-at-old-rows": (lambda sd, old: _set(sd, "optimizer", "state", 0, "exp_avg",
                                                    old["optimizer"]["state"][0]["exp_avg"]),
                               "optimizer state 0.exp_avg is [301, 16]"),
    "unlisted-tensor-shape": (lambda sd, old: _set(sd, "model", "blocks.0.1.weight", torch.zeros(31, 16)),
                              "model tensor blocks.0.1.weight is [31, 16]"),
    "unlisted-tensor-dtype": (lambda sd, old: _set(sd, "model", "norm.weight", sd["model"]["norm.weight"].half()),
                              "model tensor norm.weight is [16] float16"),
    "unlisted-state-tensor": (lambda sd, old: _set(sd, "optimizer", "state", 2, "exp_avg_sq",
                                                   torch.zeros(7)), "optimizer state 2.exp_avg_sq is [7]"),
    "tensor-added": (lambda sd, old: _set(sd, "model", "extra.weight", torch.zeros(3)),
                     "model tensor extra.weight is in OUT but not in the input"),
    "recorded-added": (lambda sd, old: _set(sd, "config", "n_vocab", NEW), "recorded config.n_vocab = 311 is in OUT"),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_verify_catches_each_mutation(repaired, tmp_path, mutation):
    src, _, out, plan = repaired
    change, expected = MUTATIONS[mutation]
    old = torch.load(src, weights_only=True)
    diffs = differences(plan, read_checkpoint(_mutated(out, tmp_path, lambda sd: change(sd, old))))
    assert any(expected in d for d in diffs), diffs


def test_a_writer_that_leaves_the_config_makes_repair_remove_out_and_exit_3(repaired, tmp_path, monkeypatch, capsys):
    src, tok, _, _ = repaired
    import ckptfix.recorded

    monkeypatch.setattr(ckptfix.recorded, "apply", lambda tree, changes: tree)  # the config is not written
    out = tmp_path / "broken.pth"
    with pytest.raises(VerifyFailed, match="recorded config.vocab_size is 301 in OUT; the plan sets it to 311"):
        ckptfix.repair(src, tok, out)
    assert not out.exists()
    with pytest.raises(SystemExit) as exc:
        main(["repair", str(src), "-t", str(tok), "-o", str(out)])
    err = capsys.readouterr().err
    assert exc.value.code == 3 and "verify failed" in err and "OUT was removed" in err and not out.exists()


def test_replacing_the_input_in_place_puts_it_back_on_a_difference(repaired, tmp_path, monkeypatch):
    """--force onto the input itself: on a difference the input is put back from its backup, unchanged."""
    import hashlib
    import shutil

    import ckptfix.recorded

    src, tok, _, _ = repaired
    path = tmp_path / "ckpt.pth"
    shutil.copy(src, path)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    monkeypatch.setattr(ckptfix.recorded, "apply", lambda tree, changes: tree)
    with pytest.raises(VerifyFailed, match="the input was put back"):
        ckptfix.repair(path, tok, path, force=True)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before


def test_a_config_value_the_plan_does_not_list_is_left_as_read(tmp_path):
    """Fuzz finding: a flat config.json whose `vocab_size` is no size (2**70) was overwritten by the writer though
    the plan did not list it; the verify stage refused OUT (exit 3). The writer now writes the plan, nothing else."""
    import json

    from safetensors.torch import save_file
    from tokenizer_factory import train_bpe_tokenizer_json

    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"model.embed_tokens.weight": torch.randn(64, 8), "lm_head.weight": torch.randn(64, 8)},
              folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 2 ** 70}))
    tok = train_bpe_tokenizer_json(tmp_path, 80, name="bpe80.json")
    ckptfix.repair(str(folder), str(tok), str(tmp_path / "out"), keep_ids=True)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == 2 ** 70


@pytest.fixture(scope="module")
def repaired_folder(tmp_path_factory):
    """An HF folder whose LM size is nested (`text_config`, as LLaVA's), repaired by ckptfix."""
    import json

    from safetensors.torch import save_file
    from tokenizer_factory import extend_tokenizer_json, train_bpe_tokenizer_json

    tmp = tmp_path_factory.mktemp("verify_folder")
    src = tmp / "model"
    src.mkdir()
    old_tok = train_bpe_tokenizer_json(tmp, 64, name="old.json")
    tok = extend_tokenizer_json(old_tok, tmp / "new.json", ["<a>", "<b>", "<c>"])
    torch.manual_seed(0)
    save_file({"model.embed_tokens.weight": torch.randn(64, 8), "lm_head.weight": torch.randn(64, 8),
               "model.norm.weight": torch.ones(8)}, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": {"vocab_size": 64},
                                                 "vision_config": {"model_type": "clip_vision_model"}}))
    out = tmp / "fixed"
    result = ckptfix.repair(str(src), str(tok), str(out), from_tokenizer=str(old_tok))
    assert result.plan.recorded == {("config", "text_config", "vocab_size"): 67}
    return src, out, result.plan


def _folder_mutated(out, tmp_path, tensors=None, config=None) -> str:
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    copy = tmp_path / "mutated"
    shutil.copytree(out, copy)
    if tensors is not None:
        sd = load_file(copy / "model.safetensors")
        tensors(sd)
        (copy / "model.safetensors").unlink()
        save_file(sd, copy / "model.safetensors")
    if config is not None:
        doc = json.loads((copy / "config.json").read_text())
        config(doc)
        (copy / "config.json").write_text(json.dumps(doc))
    return str(copy)


FOLDER_MUTATIONS = {
    "nested-config-value-left": (dict(config=lambda c: c["text_config"].update(vocab_size=64)),
                                 "recorded config.text_config.vocab_size is 64"),
    "head-left-at-old-rows": (dict(tensors=lambda sd: sd.update({"lm_head.weight": torch.zeros(64, 8)})),
                              "model tensor lm_head.weight is [64, 8]"),
    "unlisted-tensor-changed": (dict(tensors=lambda sd: sd.update({"model.norm.weight": torch.ones(8).half()})),
                                "model tensor model.norm.weight is [8] float16"),
}


def test_the_repaired_folder_matches_its_plan(repaired_folder):
    _, out, plan = repaired_folder
    assert differences(plan, read_checkpoint(str(out))) == []


@pytest.mark.parametrize("mutation", list(FOLDER_MUTATIONS))
def test_verify_catches_each_mutation_of_a_folder(repaired_folder, tmp_path, mutation):
    _, out, plan = repaired_folder
    change, expected = FOLDER_MUTATIONS[mutation]
    diffs = differences(plan, read_checkpoint(_folder_mutated(out, tmp_path, **change)))
    assert any(expected in d for d in diffs), diffs
