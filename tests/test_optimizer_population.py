"""Every optimizer users run, through inspect + repair with the default policy, then resumed.

The population comes from the ecosystem's own registries, not a hand list: every optimizer class in
`torch.optim` (enumerated), every choice of transformers' `OptimizerNames` (the class and arguments
the Trainer itself picks, `Trainer.get_optimizer_cls_and_kwargs`), torch.optim.Muon beside AdamW in the
two multi-optimizer layouts, and pytorch-optimizer's Prodigy/CAME/SOAP/AdEMAMix/Shampoo, lion-pytorch
and schedulefree where installed (skipped cleanly when not).

Each: a tiny LM trained a few real steps, saved, then repaired to a tokenizer grown by 5 tokens and to one
shrunk to a smaller vocabulary (rows moved by token string). The output either loads into the same
optimizer class over the resized model with
  - every kept row of every per-row state of the vocab tensors bit-identical to its source row,
  - every new row as `ckptfix.optim_state` says (0, the old rows' mean, the new weights, the group's lr),
  - every other state bit-identical,
  - two more steps moving every new row of the embedding and the head,
or repair exits 2 naming the state and `--policy fresh`, for exactly the optimizers whose state cannot
follow its rows (`REFUSED`).
"""

from __future__ import annotations

import inspect as pyinspect
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from ckpt_factory import TinyLM, lm_loss
from test_repair_common import same_bits
from tokenizer_factory import extend_tokenizer_json, train_bpe_tokenizer_json

import ckptfix
from ckptfix.errors import RepairError
from ckptfix.optim_state import rule_for
from ckptfix.tokenizers import load_tokenizer

EMBED, HEAD = "text_embedding.weight", "text_head.weight"
STEPS = 3

# What cannot follow its rows, and why (the repair names these states and `--policy fresh`).
REFUSED = {
    "LBFGS": "old_dirs",  # flat history over all parameters
    "SOAP": "GG",  # preconditioners over the vocab axis
    "Shampoo": "pre_cond_0",
    "bnb-one-state": "state1",  # Lion/SGD/RMSprop/Adagrad: first or second moment, not recorded
    "bnb-ademamix": "state1",  # two stacked first moments (2, rows, width)
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    d = tmp_path_factory.mktemp("optpop")
    old = train_bpe_tokenizer_json(d, 300, special=["<eos>"], name="old.json")
    grown = extend_tokenizer_json(old, d / "grown.json", ["<img>", "<audio>", "<tool>", "<think>", "zzqx"])
    small = train_bpe_tokenizer_json(d, 260, special=["<eos>"], name="small.json")
    return {"old": old, "grown": grown, "small": small, "vocab": load_tokenizer(old).size}


# ------------------------------------------------------------------------------------------ the run


def _batch(vocab: int, step: int) -> torch.Tensor:
    """16-token rows counting up from spread starts: every id appears (new rows get gradients)."""
    starts = (torch.arange(vocab // 8 + 1) * 8 + step) % vocab
    return (starts[:, None] + torch.arange(16)) % vocab


def _steps(model: TinyLM, opts: list[Any], vocab: int, steps: int, first: int = 0) -> None:
    for k in range(steps):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        batch = _batch(vocab, first + k)
        lm_loss(model, batch).backward()
        for opt in opts:
            if isinstance(opt, torch.optim.LBFGS):
                opt.step(lambda batch=batch: lm_loss(model, batch))
            else:
                opt.step()


def _train_mode(opt: Any) -> Any:
    if hasattr(opt, "train") and callable(opt.train) and "ScheduleFree" in type(opt).__name__:
        opt.train()  # schedulefree optimizers refuse to step outside train mode
    return opt


Build = Callable[[TinyLM], list[Any]]  # a model -> its optimizers (one, or Muon + AdamW)


def _hidden(model: TinyLM) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")]


def _rest(model: TinyLM) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if not (p.ndim == 2 and n.startswith("blocks."))]


def _save(model: TinyLM, opts: list[Any], path: Path, layout: str) -> None:
    sds = [o.state_dict() for o in opts]
    if layout == "single":
        obj = {"model": model.state_dict(), "optimizer": sds[0], "step": STEPS}
    elif layout == "list":  # modded-nanogpt: optimizers=[muon, adamw]
        obj = {"model": model.state_dict(), "optimizers": sds, "step": STEPS}
    elif layout == "lightning":
        obj = {"state_dict": model.state_dict(), "optimizer_states": sds, "epoch": 0, "global_step": STEPS,
               "pytorch-lightning_version": "2.5.0", "lr_schedulers": []}
    else:  # two keys
        obj = {"model": model.state_dict(), "muon": sds[0], "adamw": sds[1]}
    torch.save(obj, path)


def _load(path: Path, layout: str) -> tuple[dict, list[dict]]:
    sd = torch.load(path, weights_only=True)
    model = sd["state_dict" if layout == "lightning" else "model"]
    opts = {"single": lambda: [sd["optimizer"]], "list": lambda: sd["optimizers"],
            "lightning": lambda: sd["optimizer_states"], "keys": lambda: [sd["muon"], sd["adamw"]]}[layout]()
    return model, opts


def _flat(entry: dict) -> dict[str, Any]:
    """A state entry's tensors by the paths ckptfix uses ("GG[0]", "__bnb_optimizer_quant_state__/state1")."""
    out = {}
    for key, value in entry.items():
        if torch.is_tensor(value):
            out[key] = value
        elif isinstance(value, dict):
            out.update({f"{key}/{k}": v for k, v in value.items() if torch.is_tensor(v)})
        elif isinstance(value, (list, tuple)):
            out.update({f"{key}[{j}]": v for j, v in enumerate(value) if torch.is_tensor(v)})
    return out


def _names(model: TinyLM, opt: Any) -> dict[int, str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return dict(enumerate(by_id[id(p)] for g in opt.param_groups for p in g["params"]))


def run_case(tmp: Path, tokenizers: dict, build: Build, layout: str = "single") -> dict:
    """Train, save, repair (grown and shrunk), resume. Returns {"kind", "refused": message or None}."""
    vocab = tokenizers["vocab"]
    torch.manual_seed(0)
    model = TinyLM(vocab)
    opts = [_train_mode(o) for o in build(model)]
    _steps(model, opts, vocab, STEPS)
    src_path = tmp / "src.pt"
    _save(model, opts, src_path, layout)
    src_model, src_opts = _load(src_path, layout)
    names = [_names(model, o) for o in opts]
    report = ckptfix.inspect(src_path, tokenizers["grown"]).to_json()
    kind = report["optimizer"]["type"]
    result: dict[str, Any] = {"kind": kind, "refused": None,
                              "CKF210": [f["message"] for f in report["findings"] if f["code"] == "CKF210"]}
    for target in ("grown", "small"):
        out = tmp / f"{target}.pt"
        try:
            ckptfix.repair(src_path, tokenizers[target], out, from_tokenizer=tokenizers["old"])
        except RepairError as exc:
            result["refused"] = str(exc)
            assert not out.exists()
            return result
        sources = _sources(tokenizers["old"], tokenizers[target], vocab)
        new_model_sd, new_opts = _load(out, layout)
        part_kinds = kind.split(" + ")
        for k, (old_sd, new_sd) in enumerate(zip(src_opts, new_opts)):
            _check_state(old_sd, new_sd, names[k], part_kinds[k], sources, new_model_sd, vocab)
        _resume(build, new_model_sd, new_opts, sources)
    return result


def _sources(old: Path, new: Path, rows: int) -> list[int]:
    old_ids = load_tokenizer(old).token_to_id()
    return [old_ids.get(t, -1) if t is not None else -1 for t in load_tokenizer(new).id_to_token()]


def _check_state(old_sd: dict, new_sd: dict, names: dict[int, str], kind: str, sources: list[int],
                 new_model: dict, vocab: int) -> None:
    """Per-row states of the vocab tensors by their rule; everything else bit-identical."""
    assert old_sd["param_groups"] == new_sd["param_groups"]
    assert old_sd["state"].keys() == new_sd["state"].keys()
    for index, entry in old_sd["state"].items():
        old, new = _flat(entry), _flat(new_sd["state"][index])
        assert old.keys() == new.keys(), names[index]
        name = names[index]
        for key, t in old.items():
            rows, out = t.shape[0] if t.ndim else 0, new[key]
            if name in (EMBED, HEAD) and t.dtype == torch.uint8:  # bitsandbytes 8-bit: compare dequantized
                t, out = _dequantized(old, key), _dequantized(new, key)
            elif name in (EMBED, HEAD) and key.endswith(("absmax1", "absmax2")) and old.get(key[:-7] + "state1") \
                    is not None and old[key[:-7] + "state1"].dtype == torch.uint8:
                continue  # block scales: checked through the dequantized codes
            if name not in (EMBED, HEAD) or t.numel() <= 1 or rows != vocab:
                assert same_bits(t, out), (name, key)  # counters, column factors, other parameters
                continue
            _check_rows(t, out, sources, rule_for(kind, key), new_model[name], (name, key),
                        quantized=old[key].dtype == torch.uint8, in_place=_in_place(sources, vocab))
        for key, value in entry.items():
            if not torch.is_tensor(value) and not isinstance(value, (dict, list, tuple)):
                assert new_sd["state"][index][key] == value  # SOAP's precondition_frequency, bnb's int step


def _dequantized(flat: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """bitsandbytes' 8-bit state as values: qmap[code] * absmax[block], blocks of 256 (its CPU dequantize)."""
    n = key[-1]
    codes, absmax, qmap = flat[key], flat[f"{key[:-6]}absmax{n}"], flat[f"{key[:-6]}qmap{n}"]
    return (qmap[codes.flatten().long()] * absmax.repeat_interleave(256)[:codes.numel()]).reshape(codes.shape)


def _in_place(sources: list[int], vocab: int) -> bool:
    """Every kept row at its own index (rows appended or trailing rows dropped)."""
    return all(i in (j, -1) for j, i in enumerate(sources)) and all(i == j for j, i in enumerate(sources[:vocab]) if i >= 0)


def _check_rows(old: torch.Tensor, new: torch.Tensor, sources: list[int], rule: Any, weight: torch.Tensor,
                where: tuple, quantized: bool = False, in_place: bool = False) -> None:
    """Kept rows bit-identical (8-bit state whose rows moved: within its quantization step); new rows by rule."""
    assert rule is not None, where
    assert new.shape == (len(sources), *old.shape[1:]), where
    kept = [(j, i) for j, i in enumerate(sources) if i >= 0]
    fresh = [j for j, i in enumerate(sources) if i < 0]
    new_kept, old_kept = new[[j for j, _ in kept]], old[[i for _, i in kept]]
    step = {"rtol": 0.07, "atol": float(old.abs().max()) / 64}  # 8-bit dynamic code: < 1/64 of a block's absmax
    if not quantized or in_place:
        assert same_bits(new_kept, old_kept), where
    else:  # rows moved: their blocks were requantized
        assert torch.allclose(new_kept, old_kept, **step), where
    if not fresh:
        return
    added = new[fresh]
    if rule.new_rows == "zeros":
        assert torch.all(added == 0), where
    elif rule.new_rows == "column-mean":
        tolerance = step if quantized else {"rtol": 1e-5, "atol": 0}
        assert torch.allclose(added.double(), old.double().mean(0).expand_as(added), **tolerance), where
    elif rule.new_rows == "weights":
        assert same_bits(added, weight[fresh].to(added.dtype)), where
    elif rule.new_rows == "group-lr":
        assert torch.all(added == added.flatten()[0]) and float(added.flatten()[0]) > 0, where
    else:
        raise AssertionError((where, rule))


def _resume(build: Build, model_sd: dict, opt_sds: list[dict], sources: list[int]) -> None:
    """The same optimizer class over the resized model loads the output and moves every new row."""
    vocab = len(sources)
    torch.manual_seed(1)
    model = TinyLM(vocab)
    model.load_state_dict(model_sd)
    opts = build(model)
    for opt, sd in zip(opts, opt_sds):
        opt.load_state_dict(sd)
        _train_mode(opt)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n in (EMBED, HEAD)}
    _steps(model, opts, vocab, 2, first=5)
    fresh = [j for j, i in enumerate(sources) if i < 0]
    for n, p in model.named_parameters():
        if n in before:
            assert torch.isfinite(p).all(), n
            moved = (p.detach()[fresh] != before[n][fresh]).any(dim=1)
            assert bool(moved.all()), (n, [fresh[j] for j in torch.nonzero(~moved).flatten().tolist()])


def _outcome(result: dict, refused_state: str | None) -> None:
    """Repaired, or refused naming the state and both flags; inspect's CKF210 says so beforehand."""
    if refused_state is None:
        assert result["refused"] is None, result["refused"]
        assert not result["CKF210"], result["CKF210"]
        return
    assert result["CKF210"] and refused_state in result["CKF210"][0], result["CKF210"]
    message = result["refused"]
    assert message is not None, f"{result['kind']} was repaired; expected a refusal naming {refused_state}"
    assert refused_state in message and "--policy fresh" in message and "--policy reset" in message, message


# --------------------------------------------------------------------------------------- torch.optim


def _torch_classes() -> list[str]:
    return sorted(n for n, c in vars(torch.optim).items()
                  if pyinspect.isclass(c) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer)


# Classes that cannot run over the TinyLM alone, and where they are tested instead.
_TORCH_ELSEWHERE = {
    "Muon": "2-D parameters only: tested beside AdamW in test_muon_with_adamw",
    "SparseAdam": "sparse gradients only (an Embedding(sparse=True)): test_sparse_adam",
}


@pytest.mark.parametrize("name", _torch_classes())
def test_torch_optim(tmp_path, tokenizers, name):
    if name in _TORCH_ELSEWHERE:
        pytest.skip(_TORCH_ELSEWHERE[name])
    cls = getattr(torch.optim, name)
    kwargs = {"lr": 0.01} if "lr" in pyinspect.signature(cls).parameters and name != "LBFGS" else {}
    result = run_case(tmp_path, tokenizers, lambda m: [cls(m.parameters(), **kwargs)])
    assert result["kind"].split(" (")[0] == name, result["kind"]  # named as the optimizer is named
    _outcome(result, REFUSED.get(name))


def test_sparse_adam(tmp_path, tokenizers):
    """SparseAdam over the sparse embedding, Adam over the rest: two optimizers under two keys."""
    def build(m: TinyLM) -> list[Any]:
        m.text_embedding.sparse = True
        rest = [p for n, p in m.named_parameters() if n != EMBED]
        return [torch.optim.SparseAdam([m.text_embedding.weight], lr=0.01), torch.optim.Adam(rest, lr=0.01)]

    result = run_case(tmp_path, tokenizers, build, layout="keys")
    assert result["kind"] == "SparseAdam + Adam"
    _outcome(result, None)


@pytest.mark.parametrize("layout", ["list", "lightning", "keys"])
def test_muon_with_adamw(tmp_path, tokenizers, layout):
    """torch.optim.Muon for the hidden matrices, AdamW for embedding, head, norms and biases (modded-nanogpt's
    `optimizers: [muon, adamw]`, Lightning's `optimizer_states`, or two keys): both read and mapped."""
    build = lambda m: [torch.optim.Muon(_hidden(m), lr=0.02), torch.optim.AdamW(_rest(m), lr=0.01)]  # noqa: E731
    result = run_case(tmp_path, tokenizers, build, layout=layout)
    assert result["kind"] == "Muon + AdamW"
    _outcome(result, None)


# ------------------------------------------------------------------------------- transformers Trainer


def _hf_names() -> list[str]:
    try:
        from transformers.training_args import OptimizerNames
    except ImportError:
        return []
    return [o.value for o in OptimizerNames]


def _hf_build(name: str, tmp: Path) -> Build:
    """The optimizer class and arguments the Trainer itself builds for `optim=name` (skip: why not here)."""
    from transformers import Trainer, TrainingArguments

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            # lr 1e-3, not the Trainer's 5e-5: two steps at 5e-5 move some rows by less than a float32 ulp
            args = TrainingArguments(output_dir=str(tmp / "hf"), optim=name, use_cpu=True, report_to=[],
                                     learning_rate=1e-3)
            cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
        except Exception as exc:  # noqa: BLE001 - the Trainer's own reason (a package, a device)
            pytest.skip(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    if "model" in kwargs or name.endswith("layerwise") or "galore" in name or "apollo" in name:
        pytest.skip(f"{name}: needs the Trainer's model and target modules (GaLore/APOLLO/LOMO)")
    return lambda m: [cls(m.parameters(), **{k: v for k, v in kwargs.items() if k != "optimizer_dict"})]


# bitsandbytes' class per Trainer choice decides what is refused (see REFUSED).
_HF_REFUSED = {"ademamix_8bit": "bnb-ademamix", "paged_ademamix_8bit": "bnb-ademamix", "lion_8bit": "bnb-one-state",
               "paged_lion_8bit": "bnb-one-state", "rmsprop_bnb_8bit": "bnb-one-state", "lion_32bit": "bnb-one-state",
               "paged_lion_32bit": "bnb-one-state", "rmsprop_bnb": "bnb-one-state", "rmsprop_bnb_32bit": "bnb-one-state",
               "ademamix": "bnb-ademamix", "paged_ademamix_32bit": "bnb-ademamix"}


# GrokAdamW keeps a dict keyed by Parameter objects inside its param group (its own state_dict cannot resume:
# load_state_dict restores that dict keyed by stale tensors); ckptfix's unpickler refuses tensor-keyed dicts.
_HF_UNREADABLE = {"grokadamw"}


def _unreadable(tmp: Path, tokenizers: dict, build: Build) -> None:
    """inspect and repair say exit-2 "cannot read", never a report or a repaired file."""
    from ckptfix.errors import CkptfixError

    torch.manual_seed(0)
    model = TinyLM(tokenizers["vocab"])
    opts = build(model)
    _steps(model, opts, tokenizers["vocab"], STEPS)
    _save(model, opts, tmp / "src.pt", "single")
    with pytest.raises(CkptfixError):
        ckptfix.inspect(tmp / "src.pt", tokenizers["grown"])
    with pytest.raises(CkptfixError):
        ckptfix.repair(tmp / "src.pt", tokenizers["grown"], tmp / "out.pt", from_tokenizer=tokenizers["old"])
    assert not (tmp / "out.pt").exists()


@pytest.mark.transformers
@pytest.mark.parametrize("name", _hf_names() or ["transformers-missing"])
def test_hf_trainer_optimizer(tmp_path, tokenizers, name):
    if name == "transformers-missing":
        pytest.skip("transformers is not installed")
    build = _hf_build(name, tmp_path)
    if name in _HF_UNREADABLE:
        _unreadable(tmp_path, tokenizers, build)
        return
    try:
        run_case_result = run_case(tmp_path, tokenizers, build)
    except (RuntimeError, NotImplementedError, AssertionError) as exc:
        if "bnb" in name or "8bit" in name or "lion" in name or "ademamix" in name or "paged" in name:
            if "CUDA" in str(exc) or "cuda" in str(exc):
                pytest.skip(f"{name}: bitsandbytes needs a GPU for it here: {str(exc)[:120]}")
        raise
    refused = _HF_REFUSED.get(name)
    _outcome(run_case_result, REFUSED[refused] if refused else None)


# ------------------------------------------------------------------------------ optional packages


def _optional(module: str, attr: str) -> Any:
    mod = pytest.importorskip(module)
    cls = getattr(mod, attr, None)
    if cls is None:
        pytest.skip(f"{module} has no {attr}")
    return cls


_PACKAGES = [
    ("pytorch_optimizer", "Prodigy", {"lr": 1.0}, None),
    ("pytorch_optimizer", "CAME", {"lr": 1e-3}, None),
    ("pytorch_optimizer", "AdEMAMix", {"lr": 1e-3}, None),
    ("pytorch_optimizer", "SOAP", {"lr": 1e-3}, "SOAP"),
    ("pytorch_optimizer", "Shampoo", {"lr": 1e-3}, "Shampoo"),
    ("lion_pytorch", "Lion", {"lr": 1e-4}, None),
    ("schedulefree", "AdamWScheduleFree", {"lr": 1e-3}, None),
    ("schedulefree", "RAdamScheduleFree", {"lr": 1e-3}, None),
    ("schedulefree", "SGDScheduleFree", {"lr": 1e-2}, None),
    ("bitsandbytes.optim", "AdamW8bit", {"lr": 1e-3}, None),
    ("bitsandbytes.optim", "PagedAdamW8bit", {"lr": 1e-3}, None),
    ("bitsandbytes.optim", "AdEMAMix8bit", {"lr": 1e-3}, "bnb-ademamix"),
    ("bitsandbytes.optim", "Lion8bit", {"lr": 1e-4}, "bnb-one-state"),
    ("bitsandbytes.optim", "AdamW", {"lr": 1e-3}, None),
]


@pytest.mark.parametrize("module, attr, kwargs, refused", _PACKAGES, ids=[f"{m.split('.')[0]}.{a}" for m, a, _, _ in _PACKAGES])
def test_package_optimizer(tmp_path, tokenizers, module, attr, kwargs, refused):
    cls = _optional(module, attr)
    result = run_case(tmp_path, tokenizers, lambda m: [cls(m.parameters(), **kwargs)])
    assert attr.replace("Paged", "") in result["kind"], result["kind"]  # paging is placement, not state
    _outcome(result, REFUSED[refused] if refused else None)


def test_unknown_optimizer_is_named_by_its_states_and_refused(tmp_path, tokenizers):
    """An optimizer ckptfix does not know: `unknown (states: ...)`, never its nearest neighbour, and repair
    stops naming the flag rather than guessing what its rows mean."""
    class Odd(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.01, "betas": (0.9, 0.99), "amsgrad": False})

        @torch.no_grad()
        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    s = self.state[p]
                    s.setdefault("exp_avg", torch.zeros_like(p)).lerp_(p.grad, 0.1)
                    s.setdefault("trace", torch.zeros_like(p)).add_(p.grad)
                    p.add_(s["exp_avg"], alpha=-g["lr"])

    result = run_case(tmp_path, tokenizers, lambda m: [Odd(m.parameters())])
    assert result["kind"] == "unknown (states: exp_avg, trace)"
    _outcome(result, "trace")


# ------------------------------------------------------------------------------------------ the guard


_GUARD_CASES = [("torch.optim", "Rprop", {"lr": 0.01}), ("torch.optim", "ASGD", {"lr": 0.01}),
                ("torch.optim", "Adafactor", {"lr": 0.01}), ("torch.optim", "Adadelta", {"lr": 0.1}),
                ("bitsandbytes.optim", "AdamW8bit", {"lr": 1e-3}), ("schedulefree", "AdamWScheduleFree", {"lr": 1e-3})]


@pytest.mark.parametrize("module, attr, kwargs", _GUARD_CASES, ids=[a for _, a, _ in _GUARD_CASES])
def test_guard_remaps_live_by_the_same_table(tmp_path, tokenizers, module, attr, kwargs):
    """ResumeGuard resizing in memory gives every state the rows `ckptfix.optim_state` says, as repair does."""
    cls = _optional(module, attr)
    vocab = tokenizers["vocab"]
    torch.manual_seed(0)
    model = TinyLM(vocab)
    opt = _train_mode(cls(model.parameters(), **kwargs))
    _steps(model, [opt], vocab, STEPS)
    path = tmp_path / "src.pt"
    _save(model, [opt], path, "single")
    src = torch.load(path, weights_only=True)
    kind = ckptfix.inspect(path).to_json()["optimizer"]["type"]
    sources = _sources(tokenizers["old"], tokenizers["grown"], vocab)
    live = TinyLM(len(sources))
    live_opt = _train_mode(cls(live.parameters(), **kwargs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckptfix.ResumeGuard(live, live_opt, tokenizer=tokenizers["grown"], from_tokenizer=tokenizers["old"],
                            policy="remap", probe_steps=0).load(path)
    live_sd = live_opt.state_dict()
    for g in live_sd["param_groups"]:
        g.pop("param_names", None)
    _check_state(src["optimizer"], live_sd, _names(model, opt), kind, sources, live.state_dict(), vocab)
    _steps(live, [live_opt], len(sources), 2, first=5)
