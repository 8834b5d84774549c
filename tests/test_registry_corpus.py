"""Every class of transformers' own auto-model registries that holds a vocabulary (tests/arch_corpus.py's
registry corpus): built tiny from its config class, 2 real AdamW steps, an HF Trainer `checkpoint-2/` folder, 3
added tokens; inspect and repair must be right for each one built.

`pytest -m long` runs every registry and prints built / right / skipped (why) per registry; the CI slice runs
the composite configs issue 30 found wrong (LLaVA, Qwen2-VL, Mllama, InstructBLIP, PaliGemma, BLIP-2) and Llama.
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


def test_mllama_offset_rows_kept_and_drops_counted(tmp_path):
    """Mllama's embedding has vocab_size + 8 rows (its image tokens), the head vocab_size: clean at the
    tokenizer's size, and a shrink reports every trained row it drops, never "dropped 0"."""
    model = build_registry_model("mllama", "MllamaForConditionalGeneration", VOCAB)
    opt, sched = trainer_optimizer(model)
    registry_step(model, opt, sched, VOCAB, seed=1)
    src = save_trainer_folder(model, opt, sched, tmp_path / "run" / "checkpoint-1", step=1)
    report = ckptfix.inspect(str(src), tokenizer=str(src))
    assert not [f.code for f in report.findings if f.severity == "error"]
    assert {v.role: (v.rows, v.offset) for v in report.vocab} == {"embedding": (VOCAB + 8, 8), "head": (VOCAB, 0)}

    small = word_level_tokenizer(tmp_path / "small.json", VOCAB - 10)
    result = ckptfix.repair(str(src), str(small), str(tmp_path / "fixed"), keep_ids=True,
                            pad_to_multiple_of=1)
    changes = {c["tensor"]: c for c in result.to_json()["changes"] if ":" not in c["tensor"]}
    embed = next(c for name, c in changes.items() if "embed_tokens" in name)
    assert (embed["old_rows"], embed["new_rows"], embed["dropped"]) == (VOCAB + 8, VOCAB - 2, 10)
    loaded = type(model).from_pretrained(tmp_path / "fixed")
    assert loaded.get_input_embeddings().weight.shape[0] == VOCAB - 2
    assert torch.equal(loaded.get_input_embeddings().weight, model.get_input_embeddings().weight[:VOCAB - 2])
