"""Which recorded vocab size is the LM's, read from the config's structure (ckptfix.recorded), not a name search."""

from __future__ import annotations

from ckptfix.recorded import apply, find_recorded, recorded_rows, separate_vocabularies, updates


def roles(extras: dict) -> dict[str, str]:
    return {r.where: r.role for r in find_recorded(extras)}


def test_the_text_sub_config_is_the_lm_and_the_top_level_size_unused():
    """PaliGemma in transformers 5: a top-level vocab_size (257152) the model never reads beside text_config."""
    extras = {"config": {"model_type": "paligemma", "vocab_size": 257152,
                         "text_config": {"model_type": "gemma", "vocab_size": 293}, "vision_config": {"hidden_size": 8}}}
    assert roles(extras) == {"config.vocab_size": "unused", "config.text_config.vocab_size": "rows"}
    assert recorded_rows(extras) == {293}
    changes = updates(find_recorded(extras), {293}, 296, 296)
    assert changes == {("config", "text_config", "vocab_size"): 296}
    assert apply(extras, changes)["config"]["text_config"]["vocab_size"] == 296
    assert extras["config"]["text_config"]["vocab_size"] == 293  # the input's tree is not written through


def test_other_sub_configs_are_separate_vocabularies():
    """BLIP-2 / InstructBLIP: the Q-Former's vocab (its own BERT tokenizer) is never the LM's."""
    extras = {"config": {"text_config": {"vocab_size": 293}, "qformer_config": {"vocab_size": 30523},
                         "vision_config": {"hidden_size": 8}}}
    assert roles(extras) == {"config.text_config.vocab_size": "rows", "config.qformer_config.vocab_size": "separate"}
    assert [r.value for r in separate_vocabularies(extras)] == [30523]
    assert updates(find_recorded(extras), {293}, 296, 296) == {("config", "text_config", "vocab_size"): 296}


def test_decoder_sub_config_and_flat_configs():
    """An encoder-decoder's `decoder` is the text model (get_text_config(decoder=True)); flat configs, nanoGPT's
    model_args and litgpt's pair keep their roles."""
    extras = {"config": {"encoder": {"vocab_size": 500}, "decoder": {"vocab_size": 293}}}
    assert roles(extras) == {"config.encoder.vocab_size": "separate", "config.decoder.vocab_size": "rows"}
    shared = {"config": {"encoder": {"vocab_size": 293}, "decoder": {"vocab_size": 293}}}  # bert2bert: one tokenizer
    assert set(updates(find_recorded(shared), {293}, 296, 296)) == {("config", "encoder", "vocab_size"),
                                                                     ("config", "decoder", "vocab_size")}
    assert roles({"config": {"vocab_size": 293}, "model_args": {"vocab_size": 293}}) == {
        "config.vocab_size": "rows", "model_args.vocab_size": "rows"}
    assert roles({"config": {"vocab_size": 290, "padded_vocab_size": 320}}) == {
        "config.vocab_size": "tokens", "config.padded_vocab_size": "rows"}


def test_two_text_sub_configs_are_ambiguous_and_every_size_is_the_lms():
    """transformers raises for two candidates; ckptfix takes every size as the LM's (CKF115 names a stale one)."""
    extras = {"config": {"text_config": {"vocab_size": 293}, "decoder": {"vocab_size": 293}}}
    assert set(roles(extras).values()) == {"rows"}


def test_a_flat_config_with_a_sub_model_keeps_its_own_size_as_the_lms():
    """Evolla: the LM's size at the top level (get_text_config() is the config itself), a protein encoder's
    sub-config with its own vocabulary."""
    extras = {"config": {"model_type": "evolla", "vocab_size": 293,
                         "protein_encoder_config": {"vocab_size": 446}, "rope_scaling": {"factor": 2}}}
    assert roles(extras) == {"config.vocab_size": "rows", "config.protein_encoder_config.vocab_size": "separate"}


def test_a_wrapped_composite_config_holds_the_lm():
    """ColPali / PI0: the model wraps a whole VLM's config (`vlm_config`, its `get_text_config` the VLM's): the LM
    is the wrapped text_config; the wrapper's and the VLM's own top-level sizes are unused, a flat sibling
    sub-config (PI0's action expert `dit_config`) a separate vocabulary."""
    extras = {"config": {"model_type": "pi0", "vocab_size": 293, "dit_config": {"model_type": "gemma", "vocab_size": 500},
                         "vlm_config": {"model_type": "paligemma", "vocab_size": 257152,
                                        "text_config": {"model_type": "gemma", "vocab_size": 293},
                                        "vision_config": {"model_type": "siglip", "vocab_size": 257152}}}}
    assert roles(extras) == {"config.vocab_size": "unused", "config.dit_config.vocab_size": "separate",
                             "config.vlm_config.vocab_size": "unused", "config.vlm_config.text_config.vocab_size": "rows",
                             "config.vlm_config.vision_config.vocab_size": "separate"}
    assert updates(find_recorded(extras), {293}, 296, 296) == {("config", "vlm_config", "text_config", "vocab_size"): 296}


def test_a_config_that_contains_itself_is_walked_once():
    """A pickled config dict under many keys of itself: bounded work, no recursion error."""
    node: dict = {"model_type": "x", "vocab_size": 293}
    for i in range(60):
        node[f"c{i}_config"] = node
    assert roles({"config": node}) == {"config.vocab_size": "rows"}


def test_a_flat_encoder_decoder_names_its_decoders_vocab():
    """Marian's `decoder_vocab_size` (transformers' decoder_ prefix rule) and FSMT's `tgt_vocab_size` are the LM's;
    the encoder's (source's) `vocab_size` / `src_vocab_size` a separate vocabulary, resized with the LM only when
    it is the same size (one shared tokenizer)."""
    fsmt = {"config": {"model_type": "fsmt", "src_vocab_size": 500, "tgt_vocab_size": 293}}
    assert roles(fsmt) == {"config.src_vocab_size": "separate", "config.tgt_vocab_size": "rows"}
    assert updates(find_recorded(fsmt), {293}, 296, 296) == {("config", "tgt_vocab_size"): 296}
    marian = {"config": {"model_type": "marian", "vocab_size": 293, "decoder_vocab_size": 293}}
    assert roles(marian) == {"config.vocab_size": "separate", "config.decoder_vocab_size": "rows"}
    assert set(updates(find_recorded(marian), {293}, 296, 296)) == {("config", "vocab_size"),
                                                                     ("config", "decoder_vocab_size")}


def test_a_vocabulary_the_config_names_is_separate():
    """Pop2Piano's `composer_vocab_size` (its composer embedding's rows) is another vocabulary; BERT's
    `type_vocab_size` (token types) is no vocabulary at all."""
    extras = {"config": {"model_type": "pop2piano", "vocab_size": 293, "composer_vocab_size": 21, "type_vocab_size": 2}}
    assert roles(extras) == {"config.vocab_size": "rows", "config.composer_vocab_size": "separate"}
