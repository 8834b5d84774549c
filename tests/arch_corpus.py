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
    named = {v.name for v in wrong.vocab} | {v.tied_to for v in wrong.vocab if v.tied_to}
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
