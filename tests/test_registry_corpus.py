"""Every class of transformers' own auto-model registries that holds a vocabulary (tests/arch_corpus.py's
registry corpus): built tiny from its config class, 2 real AdamW steps, an HF Trainer `checkpoint-2/` folder, 3
added tokens; inspect and repair must be right for each one built.

`pytest -m long` runs every registry and prints built / right / skipped (why) per registry; the CI slice runs
the composite configs issue 30 found wrong (LLaVA, Qwen2-VL, Mllama, InstructBLIP, PaliGemma, BLIP-2), Llama, and
one class per cause the second round fixed (REGISTRY_FAST).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from arch_corpus import (
    REGISTRIES,
    REGISTRY_FAST,
    VOCAB,
    build_registry_model,
    check_registry_class,
    registry_classes,
    registry_step,
    save_trainer_folder,
    trainer_optimizer,
    word_level_tokenizer,
)

import ckptfix

pytest.importorskip("transformers")
pytestmark = pytest.mark.transformers


@pytest.fixture(autouse=True)
def _quiet():
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def _one_step_folder(model, tmp_path):
    """The model after one real AdamW step, saved as a Trainer `checkpoint-1/` folder (its tokenizer beside)."""
    opt, sched = trainer_optimizer(model)
    registry_step(model, opt, sched, VOCAB, seed=1)
    return save_trainer_folder(model, opt, sched, tmp_path / "run" / "checkpoint-1", step=1)


@pytest.mark.parametrize("registry,model_type", REGISTRY_FAST, ids=lambda x: x)
def test_registry_class(registry, model_type, tmp_path):
    class_name = dict(registry_classes(registry))[model_type]
    outcome = check_registry_class(registry, model_type, class_name, tmp_path)
    assert outcome.built, outcome.skipped
    assert outcome.right, outcome.problem


@pytest.mark.long
@pytest.mark.parametrize("registry", list(REGISTRIES))
def test_registry(registry, tmp_path):
    """The whole registry: every class either built and right, or skipped with the reason it cannot be built
    tiny on CPU. Printed: the counts and each class not right."""
    outcomes = []
    for i, (model_type, class_name) in enumerate(registry_classes(registry)):
        outcomes.append(check_registry_class(registry, model_type, class_name, tmp_path / str(i)))
    counts = Counter("right" if o.right else "wrong" if o.built else "skipped" for o in outcomes)
    print(f"\n{registry}: {len(outcomes)} classes, built {counts['right'] + counts['wrong']}, right {counts['right']}, "
          f"skipped {counts['skipped']}")
    for o in outcomes:
        if not o.right:
            print(f"  {o.class_name} ({o.model_type}): {'WRONG ' + o.problem if o.built else 'skipped: ' + o.skipped}")
    wrong = [f"{o.class_name}: {o.problem}" for o in outcomes if o.built and not o.right]
    assert not wrong, "\n".join(wrong)


def _mllama_checkpoint(tmp_path):
    """Trained one step on text and one on every embedding row, the 8 image rows included (ids past
    vocab_size reach them): their values and moments are the model's own history."""
    model = build_registry_model("mllama", "MllamaForConditionalGeneration", VOCAB)
    opt, sched = trainer_optimizer(model)
    registry_step(model, opt, sched, VOCAB, seed=1)
    model.get_input_embeddings()(torch.arange(VOCAB + 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, save_trainer_folder(model, opt, sched, tmp_path / "run" / "checkpoint-1", step=1)


def test_mllama_offset_rows_kept_and_drops_counted(tmp_path):
    """Mllama's embedding has vocab_size + 8 rows (its image tokens), the head vocab_size: clean at the
    tokenizer's size, and a shrink drops token rows only, counted (never "dropped 0"), the 8 rows of the model's
    own kept as its last rows."""
    model, src = _mllama_checkpoint(tmp_path)
    report = ckptfix.inspect(str(src), tokenizer=str(src))
    assert not [f.code for f in report.findings if f.severity == "error"]
    assert {v.role: (v.rows, v.offset) for v in report.vocab} == {"embedding": (VOCAB + 8, 8), "head": (VOCAB, 0)}

    small = word_level_tokenizer(tmp_path / "small.json", VOCAB - 10)
    result = ckptfix.repair(str(src), str(small), str(tmp_path / "fixed"), keep_ids=True,
                            pad_to_multiple_of=1)
    changes = {c["tensor"]: c for c in result.to_json()["changes"] if ":" not in c["tensor"]}
    embed = next(c for name, c in changes.items() if "embed_tokens" in name)
    assert (embed["old_rows"], embed["new_rows"], embed["dropped"]) == (VOCAB + 8, VOCAB - 2, 10)
    loaded = type(model).from_pretrained(tmp_path / "fixed").get_input_embeddings().weight
    old = model.get_input_embeddings().weight
    assert loaded.shape[0] == VOCAB - 2
    assert torch.equal(loaded[:VOCAB - 10], old[:VOCAB - 10]) and torch.equal(loaded[VOCAB - 10:], old[VOCAB:])


def test_mllama_new_ids_never_land_on_image_rows(tmp_path):
    """3 added tokens: ids VOCAB..VOCAB+2 get new rows (none of them an old row), the 8 image rows move after
    them (rows VOCAB+3.., where the class built at the new vocab_size keeps its own rows), bit-identical, and
    their Adam moments move with them."""
    model, src = _mllama_checkpoint(tmp_path)
    grown = word_level_tokenizer(tmp_path / "grown.json", VOCAB + 3)
    ckptfix.repair(str(src), str(grown), str(tmp_path / "fixed"), keep_ids=True, pad_to_multiple_of=1)
    fixed = tmp_path / "fixed"
    loaded = type(model).from_pretrained(fixed)
    assert loaded.config.text_config.vocab_size == VOCAB + 3
    old, new = model.get_input_embeddings().weight, loaded.get_input_embeddings().weight
    assert new.shape[0] == VOCAB + 3 + 8
    assert torch.equal(new[:VOCAB], old[:VOCAB]) and torch.equal(new[VOCAB + 3:], old[VOCAB:])
    assert not any(torch.equal(new[i], old[j]) for i in range(VOCAB, VOCAB + 3) for j in range(VOCAB + 8))
    moments = [e for e in torch.load(fixed / "optimizer.pt", weights_only=True)["state"].values()
               if e["exp_avg"].shape == new.shape]
    before = [e for e in torch.load(src / "optimizer.pt", weights_only=True)["state"].values()
              if e["exp_avg"].shape == old.shape]
    assert len(moments) == len(before) == 1
    for key in ("exp_avg", "exp_avg_sq"):
        m, b = moments[0][key], before[0][key]
        assert torch.equal(m[:VOCAB], b[:VOCAB]) and torch.equal(m[VOCAB + 3:], b[VOCAB:])
        assert not torch.equal(m[VOCAB:VOCAB + 3], b[VOCAB:VOCAB + 3])  # not the image rows' history


def test_prompt_rows_the_config_states_follow_the_token_rows(tmp_path):
    """CPM-Ant's `input_embedding` holds vocab_size + prompt_types x prompt_length rows (its prompt ids are
    vocab_size + k) while its head has vocab_size. Before, repair grew the head only (exit 0, output that did not
    load), then refused; now the config's stated product makes the 1024 rows the model's own, like Mllama's
    image rows: the new token rows go before them, and the prompt rows and their moments move unchanged."""
    model = build_registry_model("cpmant", "CpmAntForCausalLM", VOCAB)
    prompt = model.config.prompt_types * model.config.prompt_length
    assert prompt > 256  # past MAX_OFFSET: taken only because the config states it
    src = _one_step_folder(model, tmp_path)
    grown = word_level_tokenizer(tmp_path / "grown.json", VOCAB + 3)
    report = ckptfix.inspect(str(src), tokenizer=str(grown))
    assert "cpmant.input_embedding.weight" in {v.name for v in report.vocab}
    assert not [f for f in report.findings if f.code == "CKF130"]
    ckptfix.repair(str(src), str(grown), str(tmp_path / "fixed"))
    fixed = type(model).from_pretrained(tmp_path / "fixed")
    old, new = model.cpmant.input_embedding.weight.detach(), fixed.cpmant.input_embedding.weight.detach()
    assert new.shape[0] == VOCAB + 3 + prompt and fixed.config.vocab_size == VOCAB + 3
    assert torch.equal(new[:VOCAB], old[:VOCAB]) and torch.equal(new[VOCAB + 3:], old[VOCAB:])


def test_head_columns_beside_a_tied_head_grow_as_columns(tmp_path):
    """MobileBERT's logits are h @ [decoder.weight.T; dense.weight]: `cls.predictions.dense.weight` is
    (hidden - embedding_size, vocab), one column per token, in the module that holds the head's bias. Before,
    repair refused it (a vocab dimension not in a vocab tensor's place); now its columns and their Adam moments
    follow the token rows: old columns bit-identical, 3 new ones, and the class's from_pretrained loads it."""
    import transformers

    config = transformers.MobileBertConfig(vocab_size=VOCAB, hidden_size=32, embedding_size=16, num_hidden_layers=1,
                                           num_attention_heads=2, intermediate_size=32, true_hidden_size=32,
                                           intra_bottleneck_size=32, num_feedforward_networks=1)
    torch.manual_seed(0)
    model = transformers.MobileBertForMaskedLM(config)
    src = _one_step_folder(model, tmp_path)
    grown = word_level_tokenizer(tmp_path / "grown.json", VOCAB + 3)
    report = ckptfix.inspect(str(src), tokenizer=str(grown))
    assert "cls.predictions.dense.weight" in {v.name for v in report.vocab}
    ckptfix.repair(str(src), str(grown), str(tmp_path / "fixed"))
    fixed = transformers.MobileBertForMaskedLM.from_pretrained(tmp_path / "fixed")
    old, new = model.cls.predictions.dense.weight.detach(), fixed.cls.predictions.dense.weight.detach()
    assert old.shape == (16, VOCAB) and new.shape == (16, VOCAB + 3) and torch.equal(new[:, :VOCAB], old)
    index = [n for n, p in model.named_parameters() if p.requires_grad].index("cls.predictions.dense.weight")
    before = torch.load(src / "optimizer.pt", weights_only=True)
    after = torch.load(tmp_path / "fixed" / "optimizer.pt", weights_only=True)
    groups = [i for g in before["param_groups"] for i in g["params"]]
    assert len(groups) == len(list(model.parameters()))
    entry = next(e for e in after["state"].values() if e["exp_avg"].shape == (16, VOCAB + 3))
    first = next(e for e in before["state"].values() if e["exp_avg"].shape == (16, VOCAB))
    assert index >= 0 and torch.equal(entry["exp_avg"][:, :VOCAB], first["exp_avg"])
    assert torch.equal(entry["exp_avg_sq"][:, :VOCAB], first["exp_avg_sq"])
    opt2, sched2 = trainer_optimizer(fixed, like=model)
    opt2.load_state_dict(after)
    assert torch.isfinite(torch.tensor(registry_step(fixed, opt2, sched2, VOCAB + 3, seed=2)))


def test_rows_past_the_recorded_size_without_a_head_are_a_warning_a_refusal_and_a_flag(tmp_path):
    """MllamaModel (no head) has vocab_size + 8 embedding rows: at its own tokenizer's size that is CKF107, a
    warning naming both readings (the class's own rows, or a config left at an old size), not the false CKF102
    and CKF115 errors it was; after added tokens inspect has errors and repair refuses (exit 2), since which
    rows are tokens is not recorded anywhere in the folder, naming the flag that says it: `--own-rows 8`
    (any other count is refused). With it, the tokens grow and the 8 rows stay the class's, past them."""
    model = build_registry_model("mllama", "MllamaModel", VOCAB)
    src = _one_step_folder(model, tmp_path)
    same = ckptfix.inspect(str(src), tokenizer=str(word_level_tokenizer(tmp_path / "same.json", VOCAB)))
    assert [f.code for f in same.findings if f.severity != "info"] == ["CKF107"]
    grown = word_level_tokenizer(tmp_path / "grown.json", VOCAB + 3)
    assert any(f.severity == "error" for f in ckptfix.inspect(str(src), tokenizer=str(grown)).findings)
    with pytest.raises(ckptfix.CkptfixError, match=r"8 past the vocab size 203 .* no head to tell.* --own-rows 8"):
        ckptfix.repair(str(src), str(grown), str(tmp_path / "fixed"))
    assert not (tmp_path / "fixed").exists()
    with pytest.raises(ckptfix.CkptfixError, match=r"--own-rows 7: .* 8 past the vocab size 203 its config records; pass --own-rows 8"):
        ckptfix.repair(str(src), str(grown), str(tmp_path / "fixed"), own_rows=7)
    assert not (tmp_path / "fixed").exists()

    # the flag the refusal names, from a user who knows the class adds 8 rows: the class's own answer
    import transformers

    ckptfix.repair(str(src), str(grown), str(tmp_path / "fixed"), own_rows=8)
    fixed = transformers.MllamaModel.from_pretrained(tmp_path / "fixed")
    old, new = model.get_input_embeddings().weight, fixed.get_input_embeddings().weight
    assert fixed.config.text_config.vocab_size == VOCAB + 3 and new.shape[0] == VOCAB + 3 + 8
    assert torch.equal(new[:VOCAB], old[:VOCAB]) and torch.equal(new[-8:], old[-8:])  # tokens, then its own rows


def _two_part_case(tmp_path):
    """Molmo2TextModel after one step, its folder, and a tokenizer grown by 3 tokens."""
    from tokenizer_factory import extend_tokenizer_json

    model = build_registry_model("molmo2_text", "Molmo2TextModel", VOCAB)
    src = _one_step_folder(model, tmp_path)
    (tmp_path / "new").mkdir()
    extend_tokenizer_json(src / "tokenizer.json", tmp_path / "new" / "tokenizer.json", ["<a>", "<b>", "<c>"])
    return model, src, str(tmp_path / "new")


def test_an_embedding_saved_in_two_parts_is_one_table_grown_and_saved_in_parts(tmp_path):
    """Molmo2TextModel's embedding has vocab_size + additional_vocab_size rows (203 + 128); transformers 5 saves
    it as `wte.embedding` + `wte.new_embedding` (its conversion mapping, reversed: split at the middle row, 166 +
    165) and concatenates them on load; its AdamW moments are one 331-row entry. Before, repair refused it. Now
    it is read as the table the loader builds, the config's additional_vocab_size its own rows past the vocab:
    the 3 new tokens land after the 203 token rows, the 128 rows of its own stay last, and it is saved as the
    same two parts (the first as it was), which from_pretrained joins again."""
    from safetensors.torch import load_file

    model, src, new = _two_part_case(tmp_path)
    same = ckptfix.inspect(str(src), tokenizer=str(src))
    assert not [n for n in same.notes if "separate vocabulary" in n], same.notes
    assert [f.code for f in same.findings if f.severity == "error"] == []
    (table,) = same.vocab
    assert (table.name, table.parts, table.rows, table.offset, sorted(table.moments)) == (
        "wte.embedding+wte.new_embedding", ("wte.embedding", "wte.new_embedding"), 331, 128, ["exp_avg", "exp_avg_sq"])
    grown = ckptfix.inspect(str(src), tokenizer=new)
    (short,) = [f for f in grown.findings if f.code == "CKF101"]
    assert "203 rows but the tokenizer has 206" in short.message
    assert "size mismatch for <the table joined from wte.embedding and wte.new_embedding>" in short.pytorch

    result = ckptfix.repair(str(src), new, str(tmp_path / "fixed"))
    assert any("wte.embedding rows 0..165 (as it was), wte.new_embedding rows 166..333" in n for n in result.plan.notes)
    fixed = type(model).from_pretrained(tmp_path / "fixed")
    old, grown_rows = model.get_input_embeddings().weight.detach(), fixed.get_input_embeddings().weight.detach()
    assert fixed.config.vocab_size == VOCAB + 3 and grown_rows.shape == (VOCAB + 3 + 128, 32)
    assert torch.equal(grown_rows[:VOCAB], old[:VOCAB]) and torch.equal(grown_rows[VOCAB + 3:], old[VOCAB:])
    before, after = (load_file(f / "model.safetensors") for f in (src, tmp_path / "fixed"))
    assert torch.equal(after["wte.embedding"], before["wte.embedding"]) and after["wte.new_embedding"].shape[0] == 168
    (moment,) = [e for e in torch.load(tmp_path / "fixed" / "optimizer.pt", weights_only=True)["state"].values()
                 if e["exp_avg"].shape[0] == VOCAB + 3 + 128]
    (was,) = [e for e in torch.load(src / "optimizer.pt", weights_only=True)["state"].values()
              if e["exp_avg"].shape[0] == VOCAB + 128]
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(moment[key][:VOCAB], was[key][:VOCAB]) and torch.equal(moment[key][VOCAB + 3:], was[key][VOCAB:])


def test_a_table_in_parts_across_shards_repaired_in_place(tmp_path):
    """The two parts in two shards of a sharded folder: `--in-place` rewrites both shards, and from_pretrained
    joins the parts it finds through the new index."""
    import json

    from safetensors.torch import load_file, save_file

    model, src, new = _two_part_case(tmp_path)
    folder = tmp_path / "sharded"
    model.save_pretrained(folder, max_shard_size="24KB")  # both parts in one shard: one is moved to its own
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"]["wte.embedding"]
    tensors = load_file(shard)
    save_file({"wte.new_embedding": tensors.pop("wte.new_embedding")}, folder / "model-extra.safetensors",
              metadata={"format": "pt"})
    save_file(tensors, shard, metadata={"format": "pt"})
    index["weight_map"]["wte.new_embedding"] = "model-extra.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    ckptfix.repair(str(folder), new, str(folder), in_place=True)
    after = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert {after["wte.embedding"], after["wte.new_embedding"]} == {shard.stem + ".ckptfix0.safetensors",
                                                                   "model-extra.ckptfix0.safetensors"}
    fixed = type(model).from_pretrained(folder)
    old, rows = model.get_input_embeddings().weight.detach(), fixed.get_input_embeddings().weight.detach()
    assert torch.equal(rows[:VOCAB], old[:VOCAB]) and torch.equal(rows[VOCAB + 3:], old[VOCAB:])


def test_a_table_in_parts_in_a_torch_file_is_named_and_refused(tmp_path):
    """Saved in a torch file (a state_dict with both parts, which no reader joins): CKF109 names the two parts
    and repair refuses naming them, never a resize of one part as if it were the table."""
    from safetensors.torch import load_file

    _, src, new = _two_part_case(tmp_path)
    torch.save(load_file(src / "model.safetensors"), tmp_path / "weights.pt")
    same = ckptfix.inspect(str(tmp_path / "weights.pt"), tokenizer=str(src))
    (found,) = [f for f in same.findings if f.code == "CKF109"]
    assert "saved in two parts its loader concatenates, wte.embedding (166 rows) and wte.new_embedding (165)" \
        in found.message
    with pytest.raises(ckptfix.CkptfixError, match=r"saved in two parts .* wte.embedding \(166 rows\) and "
                       r"wte.new_embedding \(165\): 331 rows in all .* does not resize a table saved in parts"):
        ckptfix.repair(str(tmp_path / "weights.pt"), new, str(tmp_path / "fixed.pt"))
    assert not (tmp_path / "fixed.pt").exists()


@pytest.mark.parametrize("first,second", [((0, 4), (5, 4)), ((5, 4), (0, 4)), ((3, 4), (2, 0)), ((3, 0), (2, 0)),
                                          ((1, 4), (1, 4)), ((6, 4), (1, 4))])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_odd_tables_in_parts_give_a_report_a_repair_or_one_line(tmp_path, first, second, dtype):
    """Parts of any shape, rows or widths of 0, another dtype for the second: a report and a repair that loads
    back through the reader (or one line and exit 2), never a traceback; the input untouched."""
    import json
    import subprocess
    import sys

    import numpy as np
    from safetensors.numpy import save_file

    folder = tmp_path / "in"
    folder.mkdir()
    save_file({"wte.embedding": np.ones(first, np.float32), "wte.new_embedding": np.ones(second, dtype),
               "norm.weight": np.ones(4, np.float32)}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"vocab_size": 4, "additional_vocab_size": 1}))
    tok = word_level_tokenizer(tmp_path / "tokenizer.json", 6)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    for args in (["inspect", str(folder), "--tokenizer", str(tok)],
                 ["repair", str(folder), "--tokenizer", str(tok), "-o", str(tmp_path / "out")]):
        r = subprocess.run([sys.executable, "-m", "ckptfix", *args], capture_output=True, text=True, timeout=120)
        assert r.returncode in (0, 1, 2) and "Traceback" not in r.stderr, r.stderr
        assert r.returncode != 2 or len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_parts_are_not_joined_under_a_name_a_tensor_already_has(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"wte.embedding": np.ones((6, 4), np.float32), "wte.new_embedding": np.ones((1, 4), np.float32),
               "wte.embedding+wte.new_embedding": np.ones((7, 4), np.float32)}, tmp_path / "model.safetensors")
    model = ckptfix.inspect(str(tmp_path)).ckpt.model
    assert {"wte.embedding", "wte.new_embedding", "wte.embedding+wte.new_embedding"} <= set(model)
    assert not any(hasattr(t, "parts") for t in model.values())


def test_a_table_in_parts_splits_as_its_save_would_when_the_first_part_no_longer_fits():
    from ckptfix.checkpoint import JoinedTensor, TensorInfo

    parts = (TensorInfo("a.embedding", (166, 4), "float32", lambda: None, "1"),
             TensorInfo("a.new_embedding", (165, 4), "float32", lambda: None, "2"))
    table = JoinedTensor("a.embedding+a.new_embedding", (331, 4), "float32", locate=lambda: None, storage_id="x",
                         parts=parts)
    assert table.part_rows(334) == [166, 168] and table.part_rows(167) == [166, 1]
    assert table.part_rows(166) == [83, 83] and table.part_rows(101) == [51, 50]  # torch.chunk's split


def test_a_real_mllama_tokenizer_image_token_keeps_its_trained_row(tmp_path):
    """Llama 3.2 Vision's tokenizer has <|image|> at id vocab_size (image_token_index = 128256), looked up in the
    first of the embedding's 8 rows past the vocab. Before, inspect called the healthy pair an error (CKF101: "id
    128256 has no row"), and after added tokens repair gave <|image|> a new untrained row while its trained row
    moved past the new tokens: the model looked images up in noise, exit 0. Now it is CKF108 (info), and repair
    keeps the image row (and its moments) at the image id."""
    import json

    import transformers
    from tokenizers import AddedToken, Tokenizer

    model = build_registry_model("mllama", "MllamaForConditionalGeneration", VOCAB)
    model.config.image_token_index = VOCAB
    src = _one_step_folder(model, tmp_path)
    tok = Tokenizer.from_file(str(src.parent / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<|image|>", special=True)])

    def folder(name: str) -> str:
        (tmp_path / name).mkdir()
        tok.save(str(tmp_path / name / "tokenizer.json"))
        (tmp_path / name / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
        return str(tmp_path / name)

    real = ckptfix.inspect(str(src), tokenizer=folder("real"))
    # CKF114 is true here: the one synthetic step's batch never held <|image|>, so its exp_avg_sq row is 0
    assert [f.code for f in real.findings if f.code not in ("CKF204", "CKF114")] == ["CKF108"]
    tok.add_tokens(["<video>", "<box>", "<ref>"])
    ckptfix.repair(str(src), folder("grown"), str(tmp_path / "fixed"))
    fixed = transformers.MllamaForConditionalGeneration.from_pretrained(tmp_path / "fixed")
    old, new = model.get_input_embeddings().weight.detach(), fixed.get_input_embeddings().weight.detach()
    assert fixed.config.image_token_index == VOCAB and new.shape[0] == VOCAB + 4 + 8
    assert torch.equal(new[:VOCAB + 1], old[:VOCAB + 1]) and torch.equal(new[VOCAB + 4:], old[VOCAB:])
    after = torch.load(tmp_path / "fixed" / "optimizer.pt", weights_only=True)["state"]
    before = torch.load(src / "optimizer.pt", weights_only=True)["state"]
    (m,) = [e for e in after.values() if e["exp_avg"].shape == new.shape]
    (b,) = [e for e in before.values() if e["exp_avg"].shape == old.shape]
    assert torch.equal(m["exp_avg"][VOCAB], b["exp_avg"][VOCAB])  # the image row's history, at the image id


def test_hash_routing_tables_grow_with_the_tokens(tmp_path):
    """DeepSeek-V4's hash-MoE layers route by `tid2eid[input_ids]`, an int64 buffer (vocab, top_k) of expert ids.
    Before, it was CKF130 and repair refused; now it is a lookup whose rows follow the tokens: old rows kept, each
    new token gets top_k distinct expert ids drawn from those the table holds (the note says so), and the class's
    from_pretrained loads it and routes the new ids."""
    import transformers

    model = build_registry_model("deepseek_v4", "DeepseekV4ForCausalLM", VOCAB)
    tables = {n: b for n, b in model.named_buffers() if n.endswith("tid2eid")}
    assert tables
    torch.manual_seed(3)
    experts = model.config.num_local_experts
    for b in tables.values():  # a real checkpoint's hash: distinct experts per token
        b.copy_(torch.stack([torch.randperm(experts)[:b.shape[1]] for _ in range(b.shape[0])]))
    src = _one_step_folder(model, tmp_path)
    grown = word_level_tokenizer(tmp_path / "grown.json", VOCAB + 3)
    report = ckptfix.inspect(str(src), tokenizer=str(grown))
    lookups = [v.name for v in report.vocab if v.role == "lookup"]  # saved under the checkpoint's names (ffn.)
    assert len(lookups) == len(tables) and all(n.endswith(".gate.tid2eid") for n in lookups)
    assert not [f for f in report.findings if f.code == "CKF130"]
    result = ckptfix.repair(str(src), str(grown), str(tmp_path / "fixed"))
    assert any("drawn at random" in n for n in result.to_json()["notes"])
    fixed = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path / "fixed")
    for name, old in tables.items():
        new = dict(fixed.named_buffers())[name]
        assert new.dtype == torch.int64 and new.shape == (VOCAB + 3, old.shape[1])
        assert torch.equal(new[:VOCAB], old)
        assert all(len(set(row.tolist())) == old.shape[1] and max(row.tolist()) < experts for row in new[VOCAB:])
    opt2, sched2 = trainer_optimizer(fixed, like=model)
    opt2.load_state_dict(torch.load(tmp_path / "fixed" / "optimizer.pt", weights_only=True))
    assert torch.isfinite(torch.tensor(registry_step(fixed, opt2, sched2, VOCAB + 3, seed=2)))


def test_converted_key_layout_is_a_warning_not_a_count_error(tmp_path):
    """GTE: transformers 5 saves q/k/v and gate/up fused (31 tensors) while the optimizer holds the class's 41
    parameters: CKF205 (a warning naming the converted layout), not CKF202; a torch.save file with the same
    excess stays CKF202 (tests/test_inspect_findings.py)."""
    model = build_registry_model("gte", "GteForMaskedLM", VOCAB)
    src = _one_step_folder(model, tmp_path)
    findings = ckptfix.inspect(str(src), tokenizer=str(src)).findings
    codes = {f.code: f.severity for f in findings}
    assert codes.get("CKF205") == "warning" and "CKF202" not in codes
    (found,) = [f for f in findings if f.code == "CKF205"]
    assert "(2 vocab tensor(s) among them)" in found.message, found.message  # the embedding, the head's bias
