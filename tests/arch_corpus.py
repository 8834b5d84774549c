"""An architecture corpus: `transformers`' own model classes at tiny sizes, trained one real AdamW step under a
real scheduler and saved the way custom training loops save (`torch.save` of model, optimizer, scheduler).

`check_architecture` runs the whole contract for one architecture: inspect is clean at the right vocab and
names every vocab tensor at a wrong one; repair to a larger and a smaller tokenizer loads with
`strict=True` into the model rebuilt at that vocab, with its optimizer and scheduler, trains one finite step,
and keeps the old rows of every vocab tensor and of its moments (and every other tensor) bit-identical.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import ckptfix
from ckptfix.errors import RepairError

VOCAB = 203  # a prime: no other dimension of these configs equals it, or a multiple 8..256 of anything

_SMALL = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, max_position_embeddings=64, n_embd=32, n_layer=2, n_head=2, n_positions=64,
              d_model=32, d_ff=40, num_layers=2, num_heads=2, d_kv=16, encoder_layers=2, decoder_layers=2,
              encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=40, decoder_ffn_dim=40,
              embedding_size=32, n_inner=40, ffn_dim=40, state_size=8, num_decoder_layers=2,
              attention_hidden_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=0)

# (model_type, kind, extra config): kind is causal | mlm | s2s (the Auto class that builds it)
ARCHITECTURES: list[tuple[str, str, dict]] = [
    ("gpt2", "causal", {}), ("gpt_neox", "causal", {}), ("llama", "causal", {}),
    ("llama", "causal", {"tie_word_embeddings": True}), ("mistral", "causal", {}), ("mixtral", "causal", {}),
    ("qwen2", "causal", {}), ("qwen3", "causal", {}), ("gemma", "causal", {}), ("gemma2", "causal", {}),
    ("phi", "causal", {}), ("phi3", "causal", {}), ("opt", "causal", {}), ("bloom", "causal", {}),
    ("stablelm", "causal", {}), ("starcoder2", "causal", {}), ("olmo", "causal", {}),
    ("olmo2", "causal", {}), ("cohere", "causal", {}), ("gpt_bigcode", "causal", {}), ("xglm", "causal", {}),
    ("mpt", "causal", {}), ("granite", "causal", {}), ("biogpt", "causal", {}),
    ("glm", "causal", {}), ("nemotron", "causal", {}), ("gptj", "causal", {"rotary_dim": 8}),
    ("codegen", "causal", {"rotary_dim": 8}), ("helium", "causal", {"head_dim": 16}),
    ("mamba", "causal", {}), ("falcon_mamba", "causal", {}), ("rwkv", "causal", {}),
    ("bert", "mlm", {}), ("roberta", "mlm", {}), ("distilbert", "mlm", {}), ("albert", "mlm", {}),
    ("electra", "mlm", {}), ("deberta", "mlm", {}), ("deberta-v2", "mlm", {}), ("xlm-roberta", "mlm", {}),
    ("mpnet", "mlm", {}), ("convbert", "mlm", {}), ("roformer", "mlm", {}), ("ernie", "mlm", {}),
    ("megatron-bert", "mlm", {}), ("nystromformer", "mlm", {}), ("yoso", "mlm", {}), ("fnet", "mlm", {}),
    ("longformer", "mlm", {}), ("big_bird", "mlm", {}), ("modernbert", "mlm", {}),
    ("bart", "s2s", {}), ("marian", "s2s", {}), ("pegasus", "s2s", {}), ("t5", "s2s", {}), ("mt5", "s2s", {}),
    ("mbart", "s2s", {}), ("blenderbot", "s2s", {}), ("blenderbot-small", "s2s", {}), ("m2m_100", "s2s", {}),
    ("plbart", "s2s", {}), ("longt5", "s2s", {}), ("umt5", "s2s", {}), ("pegasus_x", "s2s", {}),
    ("t5", "s2s", {"tie_word_embeddings": False}), ("bart", "causal", {}),
]

# the default CI slice: tied and untied causal LMs, a state-space model, RWKV, MLM head biases, seq2seq ties
FAST = ["gpt2", "llama", "mamba", "rwkv", "bert", "distilbert", "bart", "t5"]


def arch_id(arch: tuple[str, str, dict]) -> str:
    mt, kind, extra = arch
    return f"{mt}-{kind}" + "".join(f"-{k}={v}" for k, v in extra.items())


def build(arch: tuple[str, str, dict], vocab: int, seed: int = 0) -> torch.nn.Module:
    import transformers

    mt, kind, extra = arch
    config = transformers.AutoConfig.for_model(mt, vocab_size=vocab, **_SMALL, **extra)
    auto = {"causal": transformers.AutoModelForCausalLM, "mlm": transformers.AutoModelForMaskedLM,
            "s2s": transformers.AutoModelForSeq2SeqLM}[kind]
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return auto.from_config(config)


def _batch(vocab: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, 12), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, vocab: int, seed: int) -> float:
    model.train()
    loss = model(**_batch(vocab, seed)).loss
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    return float(loss.detach())


def optimizer_for(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 10))
    return opt, sched


def word_level_tokenizer(path: Path, size: int) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, **{f"t{i}": i for i in range(1, size)}}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


@dataclass
class Outcome:
    arch: str
    inspect_ok: bool = False
    repair_ok: bool = False
    problem: str = ""


def vocab_tensor_names(state: dict[str, torch.Tensor], vocab: int) -> set[str]:
    """The ground truth: every tensor of the model with a dimension of the vocab size."""
    return {n for n, t in state.items() if vocab in t.shape}


def named_tensors(report: Any) -> set[str]:
    """The tensor names inspect says are vocab tensors, tied ones included; a table saved in parts (a
    `JoinedTensor`, named `first+second`) by the names of its parts, as the file holds them."""
    return {v.tied_to for v in report.vocab if v.tied_to} | {n for v in report.vocab for n in (v.parts or (v.name,))}


def check_architecture(arch: tuple[str, str, dict], folder: Path) -> Outcome:
    out = Outcome(arch_id(arch))
    folder.mkdir(parents=True, exist_ok=True)
    model = build(arch, VOCAB)
    opt, sched = optimizer_for(model)
    train_step(model, opt, sched, VOCAB, seed=1)
    src = folder / "ckpt.pt"
    state = model.state_dict()
    torch.save({"model": state, "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": 1}, src)
    expected = vocab_tensor_names(state, VOCAB)

    right = ckptfix.inspect(str(src), tokenizer=str(word_level_tokenizer(folder / "right.json", VOCAB)))
    wrong = ckptfix.inspect(str(src), tokenizer=str(word_level_tokenizer(folder / "wrong.json", VOCAB + 5)))
    errors = [f.code for f in right.findings if f.severity == "error"]
    named = named_tensors(wrong)
    missed = expected - named
    extra = named - expected
    if errors:
        out.problem = f"inspect at the right vocab: {errors}"
    elif missed or extra:
        out.problem = f"inspect named {sorted(extra)} wrongly, missed {sorted(missed)}"
    elif not any(f.severity == "error" for f in wrong.findings):
        out.problem = "inspect at a wrong vocab found no error"
    else:
        out.inspect_ok = True

    problems = []
    for new in (VOCAB + 13, VOCAB - 11):
        try:
            problems += _repair_and_resume(arch, folder, src, state, opt.state_dict(), new)
        except Exception as exc:  # a failure is a result of the corpus, reported per architecture
            problems.append(f"{new}: {type(exc).__name__}: {str(exc)[:200]}")
    out.repair_ok = not problems
    out.problem = "; ".join(filter(None, [out.problem, *problems]))
    return out


def _repair_and_resume(arch, folder: Path, src: Path, state: dict, opt_state: dict, new: int) -> list[str]:
    tok = word_level_tokenizer(folder / f"tok{new}.json", new)
    fixed = folder / f"fixed{new}.pt"
    ckptfix.repair(str(src), str(tok), str(fixed))
    for how in (dict(weights_only=True, map_location="meta"), dict(weights_only=True, mmap=True)):
        torch.load(fixed, **how)
    ck = torch.load(fixed, weights_only=True)
    problems = []
    model = build(arch, new, seed=5)
    model.load_state_dict(ck["model"], strict=True)
    opt, sched = optimizer_for(model)
    opt.load_state_dict(ck["optimizer"])
    sched.load_state_dict(ck["scheduler"])
    keep = min(VOCAB, new)
    for name, t in state.items():
        got = ck["model"][name]
        if not _same_kept(t, got, keep):
            problems.append(f"{new}: {name} changed")
    for (i, old), new_entry in zip(sorted(opt_state["state"].items()), sorted(ck["optimizer"]["state"].items())):
        for key, t in old.items():
            if not _same_kept(t, new_entry[1].get(key), keep):
                problems.append(f"{new}: moment {i}.{key} changed")
    if len(ck["optimizer"]["state"]) != len(opt_state["state"]):
        problems.append(f"{new}: {len(ck['optimizer']['state'])} of {len(opt_state['state'])} optimizer states")
    loss = train_step(model, opt, sched, new, seed=2)
    if not torch.isfinite(torch.tensor(loss)):
        problems.append(f"{new}: loss {loss}")
    return problems


def _same_kept(old: torch.Tensor, new: torch.Tensor | None, keep: int) -> bool:
    """Bit-identical, but for vocab dimensions (the rows past `keep` may be new or gone)."""
    if new is None or new.dtype != old.dtype or new.dim() != old.dim():
        return False
    if old.shape == new.shape:
        return torch.equal(old, new)
    index = tuple(slice(0, keep) if a != b else slice(None) for a, b in zip(old.shape, new.shape))
    if any(a != b and VOCAB not in (a, b) for a, b in zip(old.shape, new.shape)):
        return False
    return torch.equal(old[index], new[index])


# ---------------------------------------------------------------------------------------------------------------
# The registry corpus: every class of transformers' own auto-model registries whose models hold a vocabulary,
# built tiny from its config class (no list of architectures: a class added to transformers is tested as is),
# trained 2 real AdamW steps, saved as an HF Trainer `checkpoint-N/` folder, then grown by 3 added tokens.

# registry -> transformers' mapping (model_type -> class name) in `transformers.models.auto.modeling_auto`
REGISTRIES = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "image-text-to-text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "multimodal-lm": "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
    "speech-seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "text-to-spectrogram": "MODEL_FOR_TEXT_TO_SPECTROGRAM_MAPPING_NAMES",
    "text-to-waveform": "MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING_NAMES",
    "pretraining": "MODEL_FOR_PRETRAINING_MAPPING_NAMES",
    # heads with no output embedding: the input embedding (and anything tied to it) is the vocab tensor
    "sequence-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "question-answering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
    "token-classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "base": "MODEL_MAPPING_NAMES",  # base models: no head at all
}
# the CI slice: the composite configs issue 30 found wrong, and a plain causal LM beside them
REGISTRY_FAST = [("image-text-to-text", "llava"), ("image-text-to-text", "qwen2_vl"),
                 ("image-text-to-text", "mllama"), ("image-text-to-text", "instructblip"),
                 ("image-text-to-text", "paligemma"), ("image-text-to-text", "blip-2"), ("causal-lm", "llama"),
                 # the previous round's wrong ones, one per cause: a buffer beside encoder/decoder weights of one
                 # shape (BART), a same-shape buffer beside the embedding (IBert), a converted key layout (GTE),
                 # a target vocabulary named apart (FSMT), a wrapped VLM config (ColPali), a base model (no head)
                 ("seq2seq", "bart"), ("masked-lm", "ibert"), ("masked-lm", "gte"), ("seq2seq", "fsmt"),
                 ("pretraining", "colpali"), ("base", "llava"),
                 # this round's: prompt rows the config states, without a head (base CPM-Ant); a VQ codebook
                 # in a non-text sub-config (GLM-Image's vq_config.num_embeddings): a separate vocabulary
                 ("base", "cpmant"), ("base", "glm_image"),
                 # a decoder over audio codebooks beside a T5 text encoder (the tokenizer's vocabulary)
                 ("text-to-waveform", "musicgen"),
                 # an embedding saved in two parts that its loader concatenates (Molmo2's wte.embedding + new_embedding)
                 ("base", "molmo2_text")]
ADDED = ["<video>", "<box>", "<ref>"]
MAX_PARAMS = 30_000_000
CLASS_SECONDS = 240  # a class slower than this on a shared CPU is reported skipped, not waited for  # "tiny": what a 2-core CI runner trains two steps of in seconds
_WIDTH, _FFN, _LAYERS, _HEADS = 32, 64, 2, 2
# config attributes, by exact name, shrunk generically (whatever model they belong to)
_WIDTH_KEYS = {"hidden_size", "d_model", "n_embd", "embed_dim", "dim", "d_embed", "embedding_size", "hidden_dim",
               "word_embed_proj_dim", "projection_dim", "text_hidden_size", "vision_hidden_size", "out_hidden_size",
               "encoder_hidden_size", "decoder_hidden_size", "qformer_hidden_size", "width", "n_embed"}
_FFN_KEYS = {"intermediate_size", "ffn_dim", "d_ff", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim", "mlp_dim",
             "moe_intermediate_size", "shared_expert_intermediate_size", "decoder_intermediate_size",
             "encoder_intermediate_size", "expert_intermediate_size", "ffn_hidden_size", "intermediate_size_mlp"}
_HEAD_KEYS = {"num_attention_heads", "n_head", "num_heads", "num_key_value_heads", "encoder_attention_heads",
              "decoder_attention_heads", "n_heads", "num_kv_heads", "decoder_num_attention_heads", "n_kv_heads",
              "encoder_num_attention_heads"}
_LAYER_KEYS = {"num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
               "num_decoder_layers", "depth", "num_encoder_layers", "decoder_num_hidden_layers"}
_EXPERT_KEYS = {"num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
                "moe_num_experts": 4, "n_shared_experts": 1, "topk_group": 1, "n_group": 1}


def registry_classes(registry: str) -> list[tuple[str, str]]:
    """(model_type, class name) of one registry, as transformers lists it."""
    from transformers.models.auto import modeling_auto

    names = getattr(modeling_auto, REGISTRIES[registry], {})
    out = []
    for model_type, cls in names.items():
        for name in (cls if isinstance(cls, (list, tuple)) else [cls]):
            out.append((model_type, name))
    return out


def tiny_config(model_type: str, vocab: int, path: list[str] | None = None) -> Any:
    """The model type's own config class, every size shrunk by attribute name (sub-configs too), and the LM
    vocabulary (the sub-config `get_text_config(decoder=True)` returns, or `path`) set to `vocab`."""
    import transformers

    config_cls = transformers.CONFIG_MAPPING[model_type]
    base = config_cls()
    d = _shrink(base.to_dict())
    target = d
    for key in (_text_path(base) if path is None else path):
        target = target[key]
    target["vocab_size"] = vocab
    if "decoder_vocab_size" in target:  # a flat encoder-decoder's decoder size (get_text_config's decoder_ prefix)
        target["decoder_vocab_size"] = vocab
    _ids_below(d, vocab)
    return config_cls.from_dict(d)


def _text_path(config: Any) -> list[str]:
    """The keys from `config` to the sub-config its LM is built from: `get_text_config(decoder=True)`'s, or
    where that is the config itself, the one sub-config holding a text config of its own (PI0's `vlm_config`
    beside its action expert's `dit_config`: `get_input_embeddings` is the VLM's)."""
    path = _path_to(config, config.get_text_config(decoder=True))
    if path:
        return path
    wrapped = [k for k, v in vars(config).items() if hasattr(v, "get_text_config") and v is not config
               and v.get_text_config(decoder=True) is not v]
    return [wrapped[0], *_text_path(getattr(config, wrapped[0]))] if len(wrapped) == 1 else []


def _path_to(config: Any, text: Any, depth: int = 0) -> list[str]:
    """The attribute path from `config` to the sub-config object `text` (ColPali's vlm_config.text_config)."""
    if text is config or depth > 3:
        return []
    for key, value in vars(config).items():
        if value is text:
            return [key]
        if hasattr(value, "get_text_config") and value is not config:
            below = _path_to(value, text, depth + 1)
            if below:
                return [key, *below]
    return []


def _shrink(d: dict) -> dict:
    layers = d.get("num_hidden_layers")
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and ("model_type" in v or str(k).endswith("_config") or k in ("decoder", "encoder")):
            out[k] = _shrink(v)
        elif isinstance(v, bool) or not isinstance(v, (int, list)) or not isinstance(k, str):
            out[k] = v
        elif isinstance(v, list) and isinstance(layers, int) and len(v) == layers and layers > _LAYERS:
            continue  # per-layer lists (layer_types...): derived again from the new layer count
        elif isinstance(v, list) and v and all(isinstance(i, int) and not isinstance(i, bool) for i in v) \
                and k in _WIDTH_KEYS | _HEAD_KEYS | _LAYER_KEYS | {"depths"}:
            # per-stage sizes of a hierarchical vision tower (Florence-2's DaViT: embed_dim [128, 256, 512, 1024])
            out[k] = [_WIDTH if k in _WIDTH_KEYS else _HEADS if k in _HEAD_KEYS else min(i, _LAYERS) for i in v]
        elif isinstance(v, list):
            out[k] = v
        elif k in _WIDTH_KEYS:
            out[k] = _WIDTH
        elif k in _FFN_KEYS:
            out[k] = _FFN
        elif k in _HEAD_KEYS:
            out[k] = _HEADS
        elif k in _LAYER_KEYS:
            out[k] = min(v, _LAYERS)
        elif k == "head_dim" or k.endswith("_head_dim"):
            out[k] = _WIDTH // _HEADS
        elif k in _EXPERT_KEYS:
            out[k] = min(v, _EXPERT_KEYS[k])
        else:
            out[k] = v
    return out


def _ids_below(d: dict, vocab: int) -> None:
    """Special token ids past the tiny vocabulary (a pad id of 128004) would index no row."""
    spare = iter(range(3, vocab))
    for k, v in list(d.items()):
        if isinstance(v, dict):
            _ids_below(v, vocab)
        elif isinstance(k, str) and (k.endswith("_token_id") or k.endswith("_token_index") or k.endswith("_token_ids")) and v is not None:
            fixed = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0}
            if isinstance(v, int) and not isinstance(v, bool) and v >= vocab:
                d[k] = fixed.get(k, vocab - 1 - next(spare) % 16)
            elif isinstance(v, list):
                d[k] = [i if not isinstance(i, int) or i < vocab else fixed.get(k, 2) for i in v]


def build_registry_model(model_type: str, class_name: str, vocab: int, seed: int = 0) -> torch.nn.Module:
    """The class built tiny. Where `get_text_config(decoder=True)` names a decoder whose heads are per-codebook
    tables (MusicGen: audio codes) and the input embedding is another sub-config's vocabulary (the T5 text
    encoder's, the processor's tokenizer's), the vocabulary set to `vocab` is the input embedding's: the
    class's own answer to which vocabulary its tokenizer indexes."""
    import transformers

    cls = getattr(transformers, class_name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls(tiny_config(model_type, vocab))
        embed = model.get_input_embeddings()
        rows = getattr(embed, "num_embeddings", None)
        # only where the decoder's heads are per-codebook tables (audio codes): an encoder-decoder whose
        # encoder size was left at its default (T5Gemma) is still built from get_text_config's
        codebooks = isinstance(model.get_output_embeddings(), torch.nn.ModuleList)
        path = _vocab_path_with(model.config.to_dict(), rows) \
            if codebooks and rows and not vocab <= rows <= vocab + 256 else None
        if path:
            LM_PATHS[class_name] = ".".join([*path, "vocab_size"])
        torch.manual_seed(seed)
        return cls(tiny_config(model_type, vocab, path))


#: class name -> the config path of its tokenizer's vocabulary, where that is not get_text_config's
LM_PATHS: dict[str, str] = {}


def _vocab_path_with(config: dict, rows: int) -> list[str] | None:
    """The one sub-config (one level down) whose vocab_size is `rows`."""
    found = [k for k, v in config.items() if isinstance(v, dict) and v.get("vocab_size") == rows]
    return found if len(found) == 1 else None


def trainer_optimizer(model: torch.nn.Module, like: torch.nn.Module | None = None) -> tuple[torch.optim.Optimizer, Any]:
    """The HF Trainer's AdamW: decay and no-decay groups by its own rule, and its linear schedule. `like`: the
    model the saved optimizer was built for (a resumed run groups the same parameter names; a class whose
    from_pretrained leaves other parameters trainable than its constructor does is not what is tested here)."""
    import transformers

    ref = like if like is not None else model
    decay = set(transformers.Trainer.get_decay_parameter_names(None, ref))
    trained = {n for n, p in ref.named_parameters() if p.requires_grad}
    params = [(n, p) for n, p in model.named_parameters() if n in trained]
    groups = [{"params": [p for n, p in params if n in decay], "weight_decay": 0.01},
              {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3)
    return opt, transformers.get_linear_schedule_with_warmup(opt, 1, 10)


def registry_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, vocab: int, seed: int) -> float:
    """One real AdamW step: the model's own loss on text alone where its forward takes that, else the LM
    path's (input embedding, then output embedding): the vocab tensors and their moments train either way."""
    model.train()
    batch = _batch(vocab, seed)
    try:
        loss = model(**batch).loss
        if loss is None or not torch.isfinite(loss):
            raise ValueError("no finite loss")
    except Exception:
        opt.zero_grad()
        loss = _embedding_loss(model, batch["input_ids"])
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    return float(loss.detach())


def _embedding_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    x = model.get_input_embeddings()(ids)
    head = model.get_output_embeddings()
    if isinstance(head, torch.nn.Linear) and head.in_features == x.shape[-1]:
        logits = head(x)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids.reshape(-1))
    return x.float().square().mean()


def model_vocab_names(model: torch.nn.Module, vocab: int) -> set[str]:
    """The ground truth: the state_dict names of `get_input_embeddings`/`get_output_embeddings` (weight and
    bias) and of every tensor tied to them, and any other tensor with a dimension of the vocab size."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    params = [m.weight for m in (embed, head) if m is not None and isinstance(getattr(m, "weight", None), torch.Tensor)]
    if head is not None and isinstance(getattr(head, "bias", None), torch.Tensor):
        params.append(head.bias)
    # the LM's: an encoder-decoder's encoder embedding has its own vocabulary (its own tokenizer and size);
    # rows past the vocab are the model's own (Mllama's 8 image rows) when the class builds them from the
    # LM's vocab size (CPM-Ant's 1024 prompt rows): the table grows when the class is built for a larger one
    grown = _grown_with_vocab(model)
    state = model.state_dict(keep_vars=True)
    params = [p for p in params if p.dim() and (any(vocab <= d <= vocab + 256 for d in p.shape)
                                                or any(t is p for n, t in state.items() if n in grown))]
    return {n for n, t in state.items() if any(t is p for p in params) or (t.dim() and vocab in t.shape)}


def _grown_with_vocab(model: torch.nn.Module) -> set[str]:
    """The tensors whose shape changes when the class is built (on the meta device) from its config with the
    LM's vocab size 3 larger: transformers' own answer to which tensors the vocab size shapes."""
    import copy

    config = copy.deepcopy(model.config)
    *path, key = _lm_vocab_path(config, type(model).__name__).split(".")
    text = config
    for part in path:
        text = getattr(text, part)
    setattr(text, key, getattr(text, key) + 3)
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            grown = type(model)(config).state_dict()
    except Exception:  # noqa: BLE001 - a class that does not build on meta: the size rule alone
        return set()
    return {n for n, t in model.state_dict().items() if n in grown and grown[n].shape != t.shape}


@dataclass
class RegistryOutcome:
    registry: str
    model_type: str
    class_name: str
    built: bool = False
    right: bool = False
    skipped: str = ""  # why the class could not be built tiny on CPU
    problem: str = ""


def check_registry_class(registry: str, model_type: str, class_name: str, folder: Path) -> RegistryOutcome:
    """The whole contract for one class (see the section's comment), as a result, never an exception."""
    import signal

    def too_slow(*_):
        raise TimeoutError(f"over {CLASS_SECONDS} s on CPU")

    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(CLASS_SECONDS)
    try:
        return _check_registry_class(registry, model_type, class_name, folder)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _check_registry_class(registry: str, model_type: str, class_name: str, folder: Path) -> RegistryOutcome:
    out = RegistryOutcome(registry, model_type, class_name)
    try:
        model = build_registry_model(model_type, class_name, VOCAB)
        params = sum(p.numel() for p in model.parameters())
        if params > MAX_PARAMS:
            out.skipped = f"{params / 1e6:.0f}M parameters after shrinking"
            return out
        embed = model.get_input_embeddings()
        if embed is None:
            out.skipped = "no input embedding"
            return out
        if isinstance(embed, torch.nn.ModuleList):
            out.skipped = f"its input embedding is {len(embed)} per-codebook tables (audio codes): no text vocabulary"
            return out
        opt, sched = trainer_optimizer(model)
        for seed in (1, 2):
            registry_step(model, opt, sched, VOCAB, seed)
        src = save_trainer_folder(model, opt, sched, folder / "run" / "checkpoint-2", step=2)
        info = _loading_info(type(model), src)
    except Exception as exc:
        out.skipped = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        return out
    if info:
        out.skipped = f"its own save_pretrained does not reload: {str(info)[:160]}"
        return out
    out.built = True
    try:
        out.problem = _check_folder(model, src, folder)
    except Exception as exc:  # a failure is a result of the corpus, reported per class
        out.problem = f"{type(exc).__name__}: {str(exc)[:300]}"
    out.right = not out.problem
    return out


def save_trainer_folder(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, folder: Path,
                        step: int) -> Path:
    """What `Trainer._save_checkpoint` writes (model, config, optimizer, scheduler, state, rng), and a
    processor's files beside the tokenizer's."""
    import json

    from transformers import PreTrainedTokenizerFast

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(folder)
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    torch.save(sched.state_dict(), folder / "scheduler.pt")
    torch.save({"python": None, "cpu": torch.get_rng_state()}, folder / "rng_state.pth")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    tok = word_level_tokenizer(folder.parent / "tokenizer.json", VOCAB)
    PreTrainedTokenizerFast(tokenizer_file=str(tok), unk_token="<unk>", pad_token="t1").save_pretrained(folder)
    (folder / "special_tokens_map.json").write_text('{"pad_token": "t1", "unk_token": "<unk>"}\n')
    for name, text in PROCESSOR_FILES.items():
        (folder / name).write_text(text)
    return folder


PROCESSOR_FILES = {"preprocessor_config.json": '{"image_processor_type": "ImageProcessor", "size": 32}\n',
                   "processor_config.json": '{"processor_class": "Processor", "image_seq_length": 4}\n',
                   "chat_template.jinja": "{% for m in messages %}{{ m['content'] }}{% endfor %}\n"}


def _loading_info(cls: Any, folder: Path) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, info = cls.from_pretrained(folder, output_loading_info=True)
    return {k: v for k, v in info.items() if v and k != "error_msgs"}


def _check_folder(model: torch.nn.Module, src: Path, folder: Path) -> str:
    import json

    from safetensors.torch import load_file
    from tokenizer_factory import extend_tokenizer_json

    saved = _safetensors(src, load_file)
    groups = _saved_names(model_vocab_names(model, VOCAB), model, saved)
    expected = {k for g in groups for k in g}
    old_tok = src.parent / "tokenizer.json"
    new_dir = folder / "new"
    new_dir.mkdir()
    extend_tokenizer_json(old_tok, new_dir / "tokenizer.json", ADDED)
    (new_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))

    right = ckptfix.inspect(str(src), tokenizer=str(src))
    wrong = ckptfix.inspect(str(src), tokenizer=str(new_dir))
    errors = [f.code for f in right.findings if f.severity == "error"]
    named = named_tensors(wrong)
    if errors:
        return f"inspect at its tokenizer's size: {errors}"
    if named != expected:
        return f"inspect named {sorted(named - expected)} wrongly, missed {sorted(expected - named)}"
    if not any(f.severity == "error" for f in wrong.findings):
        return "inspect after 3 added tokens found no error"

    fixed = folder / "fixed"
    try:
        ckptfix.repair(str(src), str(new_dir), str(fixed))
    except RepairError as exc:
        if "--own-rows" not in str(exc):
            raise
        # the refusal names the flag a user who knows the class passes (CKF107: a base model whose embedding
        # has rows past its vocab): the rows the class adds, as the model built from its config has them
        ckptfix.repair(str(src), str(new_dir), str(fixed), own_rows=_class_own_rows(model))
    info = _loading_info(type(model), fixed)
    if info:
        return f"from_pretrained of the repaired folder: {info}"
    problems = _compare(src, fixed, saved, load_file, _lm_vocab_path(model.config, type(model).__name__), groups)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = type(model).from_pretrained(fixed)
    opt, sched = trainer_optimizer(resumed, like=model)
    opt.load_state_dict(torch.load(fixed / "optimizer.pt", weights_only=True))
    sched.load_state_dict(torch.load(fixed / "scheduler.pt", weights_only=True))
    loss = registry_step(resumed, opt, sched, VOCAB + len(ADDED), seed=3)
    if not torch.isfinite(torch.tensor(loss)):
        problems.append(f"resumed loss {loss}")
    return "; ".join(problems)


def _class_own_rows(model: torch.nn.Module) -> int:
    """The rows the model's class adds to its input embedding past the LM's vocab size (MllamaModel: 8)."""
    text: Any = model.config
    *path, key = _lm_vocab_path(model.config, type(model).__name__).split(".")
    for part in path:
        text = getattr(text, part)
    return model.get_input_embeddings().weight.shape[0] - getattr(text, key)


def _saved_names(names: set[str], model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> list[tuple[str, ...]]:
    """The names `save_pretrained` gave those tensors (transformers 5 saves some models under their checkpoint
    names, not their module names; a tied copy is not saved), found by value, each one a random init: one name
    each, or the names of the row blocks a tensor is saved as, in row order (Molmo2's embedding as
    `wte.embedding` + `wte.new_embedding`, which its loader concatenates)."""
    state = model.state_dict()
    out = []
    for w in (state[n] for n in names):
        whole = [(k,) for k, t in saved.items() if t.shape == w.shape and torch.equal(t, w)]
        out += whole or [_row_blocks(w, saved)]
    return [names for names in dict.fromkeys(out) if names]


def _row_blocks(w: torch.Tensor, saved: dict[str, torch.Tensor]) -> tuple[str, ...]:
    """The saved tensors that are consecutive row blocks of `w`, in order, when together they are all of it."""
    starts = {}
    for k, t in saved.items():
        if w.dim() and t.dim() == w.dim() and t.shape[1:] == w.shape[1:] and 0 < t.shape[0] < w.shape[0]:
            for start in range(w.shape[0] - t.shape[0] + 1):
                if torch.equal(w[start:start + t.shape[0]], t):
                    starts[start] = k
                    break
    order, row = [], 0
    while row in starts:
        order.append(starts[row])
        row += saved[starts[row]].shape[0]
    return tuple(order) if row == w.shape[0] else ()


def _joined(tensors: dict[str, torch.Tensor], groups: list[tuple[str, ...]]) -> dict[str, torch.Tensor]:
    """`tensors` with each group of row blocks concatenated under its first name: the table the loader builds."""
    out = {k: t for k, t in tensors.items() if not any(k in g for g in groups if len(g) > 1)}
    for g in groups:
        if len(g) > 1 and all(k in tensors for k in g):
            out[g[0]] = torch.cat([tensors[k] for k in g])
    return out


def _safetensors(folder: Path, load_file: Any) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _lm_vocab_path(config: Any, class_name: str = "") -> str:
    """Where config.json records the LM's vocab size: the `get_text_config(decoder=True)` sub-config's
    `vocab_size`, spelled as the class stores it (FSMT's attribute_map: `tgt_vocab_size`); or the input
    embedding's (`LM_PATHS`, where `build_registry_model` found it is another sub-config's)."""
    if class_name in LM_PATHS:
        return LM_PATHS[class_name]
    path = _text_path(config)
    text = config
    for key in path:
        text = getattr(text, key)
    return ".".join([*path, getattr(text, "attribute_map", {}).get("vocab_size", "vocab_size")])


def _compare(src: Path, fixed: Path, saved: dict, load_file: Any, want: str, groups: list[tuple[str, ...]]) -> list[str]:
    """Old rows and moments bit-identical (a table saved in parts compared as the table its loader joins), every
    other tensor and file untouched, the config changed only in the LM vocab size, the processor's files
    carried, the new tokenizer where the processor reads it."""
    import json

    problems = []
    saved, new = _joined(saved, groups), _joined(_safetensors(fixed, load_file), groups)
    problems += [f"{n} changed" for n, t in saved.items() if not _rows_kept(t, new.get(n))]
    old_opt = torch.load(src / "optimizer.pt", weights_only=True)
    new_opt = torch.load(fixed / "optimizer.pt", weights_only=True)
    if old_opt["state"].keys() != new_opt["state"].keys():
        problems.append("optimizer state entries changed")
    for i, entry in old_opt["state"].items():
        problems += [f"moment {i}.{k} changed" for k, t in entry.items() if not _rows_kept(t, new_opt["state"][i].get(k))]
    old_cfg, new_cfg = (json.loads((f / "config.json").read_text()) for f in (src, fixed))
    changed = sorted(_diff_paths(old_cfg, new_cfg))
    # the text config's size, and any other one recording the same vocabulary (Moshi's depth decoder's)
    if want not in changed or any(_get(old_cfg, p) != VOCAB for p in changed):
        problems.append(f"config.json changed at {changed}, not {want}")
    for name in [*PROCESSOR_FILES, "special_tokens_map.json", "rng_state.pth", "scheduler.pt"]:
        if (src / name).read_bytes() != (fixed / name).read_bytes():
            problems.append(f"{name} not carried")
    if (fixed / "tokenizer.json").read_bytes() != (fixed.parent / "new" / "tokenizer.json").read_bytes():
        problems.append("the new tokenizer.json is not where the processor reads it")
    return problems


def _get(config: dict, path: str) -> Any:
    for key in path.split("."):
        config = config.get(key) if isinstance(config, dict) else None
    return config


def _diff_paths(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [p for k in a.keys() | b.keys() for p in _diff_paths(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [prefix.rstrip(".")]


def _rows_kept(old: torch.Tensor, new: torch.Tensor | None) -> bool:
    """Bit-identical, but for rows past the old ones along the first (or a bias's last) axis; or, for a tensor
    with rows of the model's own past the LM vocabulary (Mllama's image rows), the new rows between the LM's
    old ones and those."""
    if new is None or new.dtype != old.dtype or new.dim() != old.dim():
        return False
    if old.shape == new.shape:
        return torch.equal(old, new)
    differ = [i for i, (a, b) in enumerate(zip(old.shape, new.shape)) if a != b]
    if len(differ) != 1 or new.shape[differ[0]] < old.shape[differ[0]]:
        return False
    axis, added = differ[0], new.shape[differ[0]] - old.shape[differ[0]]
    if torch.equal(old, new.narrow(axis, 0, old.shape[axis])):
        return True
    own = old.shape[axis] - VOCAB
    return 0 < own and torch.equal(old.narrow(axis, 0, VOCAB), new.narrow(axis, 0, VOCAB)) \
        and torch.equal(old.narrow(axis, VOCAB, own), new.narrow(axis, VOCAB + added, own))
