"""Repairing a repaired checkpoint keeps every Adam state: three repairs in a row (grow, shrink, grow) of a real
`transformers.Trainer` folder with an untied head (embedding and head share a shape, so only the record or
the folder's own tokenizer can say which moment is which), moments bit-identical for every kept token's row
at every hop.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_repair_common import same_bits
from tokenizer_factory import make_hf_tokenizer_folder

import ckptfix

pytestmark = pytest.mark.transformers
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

# Added tokens per hop: grow by 3, shrink to 1 (<c> moves from id 302 to 300), grow by 3 in another order.
HOPS = [["<a>", "<b>", "<c>"], ["<c>"], ["<d>", "<c>", "<a>"]]


def trainer_checkpoint(d, tok_folder):
    tok = transformers.AutoTokenizer.from_pretrained(tok_folder)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=len(tok), n_positions=32,
                                  bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    args = transformers.TrainingArguments(
        output_dir=str(d / "out"), max_steps=3, save_steps=3, report_to=[], use_cpu=True, logging_steps=1,
        per_device_train_batch_size=4, learning_rate=1e-3, warmup_steps=1, disable_tqdm=True,
        dataloader_num_workers=0, seed=0)
    ids = torch.randint(0, len(tok), (12, 12), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    transformers.Trainer(model=transformers.GPT2LMHeadModel(cfg), args=args, train_dataset=data,
                         processing_class=tok).train()
    return d / "out" / "checkpoint-3"


def token_ids(folder) -> dict[str, int]:
    return tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab(with_added_tokens=True)


def vocab_rows(folder) -> int:
    return json.loads((folder / "config.json").read_text())["vocab_size"]


def moments(folder) -> dict[int, dict[str, torch.Tensor]]:
    state = torch.load(folder / "optimizer.pt", weights_only=True)["state"]
    return {i: {k: v for k, v in s.items() if k != "step"} for i, s in state.items()}


def test_three_repairs_in_a_row_keep_every_adam_state(tmp_path):
    base = make_hf_tokenizer_folder(tmp_path, 300, name="tok0")
    ckpt = trainer_checkpoint(tmp_path, base)
    before = moments(ckpt)
    assert len(before) >= 10 and all(len(s) == 2 for s in before.values())
    current = ckpt
    for hop, added in enumerate(HOPS, 1):
        new_tok = make_hf_tokenizer_folder(tmp_path, 300, added=added, name=f"tok{hop}")
        out = tmp_path / f"hop{hop}"
        result = ckptfix.repair(current, new_tok, out)
        record = json.loads((out / "ckptfix.json").read_text())
        assert record["optimizer_state"] == "remapped", result.to_json()["notes"]
        names = record.get("param_names")
        assert names is None or all(isinstance(n, str) for n in names)  # real or absent, never null
        old_ids, new_ids = token_ids(current), token_ids(out)
        assert new_ids == token_ids(new_tok)  # the output folder carries the new tokenizer
        old_rows, new_rows = vocab_rows(current), vocab_rows(out)  # rows may exceed the tokens (a reserve)
        assert new_rows >= len(new_ids)
        after = moments(out)
        assert after.keys() == before.keys()  # every Adam state kept
        vocab_moments = 0
        for index, state in before.items():
            assert after[index].keys() == state.keys()
            for key, old in state.items():
                new = after[index][key]
                if old.shape[:1] == (old_rows,) and new.shape[:1] == (new_rows,) and old.dim() == 2:
                    vocab_moments += 1
                    for token, i in old_ids.items():
                        if token in new_ids:
                            assert same_bits(new[new_ids[token]], old[i]), (hop, index, key, token)
                else:
                    assert same_bits(new, old), (hop, index, key)
        assert vocab_moments == 4  # exp_avg and exp_avg_sq of wte and lm_head
        moved = [t for t in old_ids if t in new_ids and old_ids[t] != new_ids[t]]
        assert hop != 2 or moved == ["<c>"]  # the shrink moved <c> by token string, not by id
        report = ckptfix.inspect(out, new_tok)
        assert report.exit_code == 0, [f.message for f in report.findings]
        assert not any(f.code == "CKF201" for f in report.findings)  # moments still match their parameters
        assert [f.severity for f in report.findings if f.code == "CKF302"] == ["info"]  # a finished schedule
        current, before = out, after
