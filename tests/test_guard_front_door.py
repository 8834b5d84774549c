"""Issue 33, items 4: the checks a user who trains with the Hugging Face Trainer or loads state by hand
relies on. The Trainer callback compares the tokenizer it is given (`processing_class`) with the model's
embedding at train start (CKF824: the run would die with `IndexError: index out of range in self` at the
first batch holding a new token), and `check_training_setup` compares every loaded optimizer moment with its
parameter for the for-loop, foreach and fused AdamW alike (CKF822). Real models, optimizers, tokenizers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ckptfix.guard import ResumeError, TrainingSetupError, check_training_setup

CKF822 = ("CKF822 error: the optimizer state of 1 parameter(s) has another shape than the parameter (state loaded "
          "by position onto other parameters, or a resized vocab without resized moments). optimizer.load_state_dict "
          "never checks this: the for-loop and foreach AdamW raise at the first step(), fused=True (Trainer's "
          "adamw_torch_fused) reads past the moments (NaN weights, heap corruption) or uses other rows' history. "
          "Fix: `ckptfix repair CKPT --tokenizer TOK -o FIXED` (moments follow their rows), or load with "
          "ResumeGuard(policy='remap'). [embed.weight [1000, 8] <- exp_avg [1001, 8]]")


class Tiny(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, 8)
        self.head = nn.Linear(8, vocab, bias=False)

    def forward(self, ids):
        return self.head(self.embed(ids))


def _step(model, opt):
    ids = torch.randint(0, model.embed.num_embeddings, (4, 6), generator=torch.Generator().manual_seed(0))
    nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("impl", ["for-loop", "foreach", "fused"])
def test_check_training_setup_catches_moments_loaded_by_hand(impl):
    """A 1001-row run's optimizer state loaded by hand into a 1000-row model: torch accepts it silently."""
    kw = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[impl]
    torch.manual_seed(0)
    old = Tiny(1001)
    opt_old = torch.optim.AdamW(old.parameters(), lr=1e-3, **kw)
    _step(old, opt_old)
    model = Tiny(1000)
    model.head = nn.Linear(8, 1001, bias=False)  # only the embedding shrank: one tensor misfits
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **kw)
    opt.load_state_dict(opt_old.state_dict())  # no error: torch does not compare moments with parameters
    with pytest.raises(TrainingSetupError) as err:
        check_training_setup(model, opt)
    assert [str(p) for p in err.value.problems] == [CKF822]


def test_check_training_setup_passes_state_that_fits():
    torch.manual_seed(0)
    model = Tiny(100)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    _step(model, opt)
    resumed = Tiny(100)
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-3, fused=True)
    opt2.load_state_dict(opt.state_dict())
    assert check_training_setup(resumed, opt2) == []


transformers = pytest.importorskip("transformers")


@pytest.mark.transformers
def test_hf_callback_checks_the_processing_class_against_the_embedding(tmp_path):
    """A 519-token tokenizer (512 + 7 added) given to a Trainer whose model has 512 rows: stopped at train
    begin with CKF824, before any step (without the callback: IndexError at the first new token)."""
    from tokenizer_factory import make_hf_tokenizer_folder

    from ckptfix.integrations.transformers import ResumeGuardCallback

    folder = make_hf_tokenizer_folder(tmp_path, 512, added=[f"<new{i}>" for i in range(7)], name="tok")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert len(tok) == 519
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=512,
                                                                 n_positions=32))
    ids = torch.randint(0, 519, (8, 12), generator=torch.Generator().manual_seed(0))
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, report_to=[], use_cpu=True,
                                          per_device_train_batch_size=4, save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, processing_class=tok, callbacks=[ResumeGuardCallback()],
                                   train_dataset=[{"input_ids": r, "labels": r} for r in ids])
    with pytest.raises(ResumeError) as err:
        trainer.train()
    assert [str(p) for p in err.value.problems] == [
        "CKF824 error: the tokenizer has 519 tokens but the model's embedding has 512 rows: token ids 512..518 "
        "cannot be looked up (IndexError on CPU, a device-side assert on GPU). Resize the model first "
        "(model.resize_token_embeddings(len(tokenizer)) before building the optimizer), then load with "
        "policy='remap'. [transformer.wte.weight]"]
    assert trainer.state.global_step == 0
    model.resize_token_embeddings(len(tok))  # the fix it names: then the same run trains
    trainer = transformers.Trainer(model=model, args=args, processing_class=tok, callbacks=[ResumeGuardCallback()],
                                   train_dataset=[{"input_ids": r, "labels": r} for r in ids])
    trainer.train()
    assert trainer.state.global_step == 2
