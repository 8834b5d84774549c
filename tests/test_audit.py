"""The audit (ckptfix/audit.py) on checkpoints whose vocab-sized values sit where ckptfix has no reader.

Every checkpoint here is built for real: real torch optimizers (AdamW, SGD with momentum, and two small
`torch.optim.Optimizer` subclasses that keep their state the way Shampoo/SOAP-style and nested-state
optimizers do: lists of tensors, dicts of tensors) after real steps, saved with torch.save; the VLM case is
transformers' own LlavaForConditionalGeneration saved with save_pretrained. For each: inspect names every
value that carries the old vocab size, and repair either handles it right (the output loads into the model
built at the new vocab, with its optimizer, and takes one finite step) or refuses with exit 2 naming it.
No case may end in exit 0 with a stale value (`_assert_no_stale`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from ckpt_factory import TinyLM, lm_loss, make_batches
from tokenizer_factory import train_sentencepiece
from torch import nn

import ckptfix
from ckptfix.cli import main

OLD, NEW = 301, 311  # primes: no other dimension of these models equals them
DIM = 16


class ListStateSGD(torch.optim.Optimizer):
    """Momentum kept as a list of tensors per parameter (SOAP/Shampoo keep their preconditioners so)."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["buffers"] = [torch.zeros_like(p), torch.zeros_like(p)]
                m, v = state["buffers"]
                state["step"] += 1
                m.mul_(0.9).add_(p.grad)
                v.mul_(0.99).addcmul_(p.grad, p.grad, value=0.01)
                p.add_(m / (v.sqrt() + 1e-8), alpha=-group["lr"])


class NestedStateAdam(torch.optim.Optimizer):
    """Adam moments kept in a nested dict per parameter (`state[p]["moments"]["m"]`)."""

    def __init__(self, params, lr=1e-3):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["moments"] = {"m": torch.zeros_like(p), "v": torch.zeros_like(p)}
                mo = state["moments"]
                state["step"] += 1
                mo["m"].mul_(0.9).add_(p.grad, alpha=0.1)
                mo["v"].mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                p.add_(mo["m"] / (mo["v"].sqrt() + 1e-8), alpha=-group["lr"])


def _steps(model: nn.Module, optimizers: list[torch.optim.Optimizer], vocab: int, n: int = 4) -> None:
    for ids in make_batches(vocab, n, seed=3):
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss = lm_loss(model, ids)
        loss.backward()
        for opt in optimizers:
            opt.step()
        assert math.isfinite(loss.item())


def _split(model: TinyLM) -> tuple[list, list]:
    """(the embedding and head, everything else): two optimizers, as modded-nanogpt gives Muon the matrices."""
    vocab = [model.embedding.weight, model.head.weight]
    rest = [p for p in model.parameters() if all(p is not q for q in vocab)]
    return vocab, rest


def _one_optimizer(kind):
    model = TinyLM(OLD, DIM)
    opt = kind(model.parameters())
    _steps(model, [opt], OLD)
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 4}


def _two_optimizers(layout: str):
    torch.manual_seed(0)
    model = TinyLM(OLD, DIM)
    vocab, rest = _split(model)
    muon = torch.optim.SGD(rest, lr=1e-2, momentum=0.9)
    adamw = torch.optim.AdamW(vocab, lr=1e-3)
    _steps(model, [muon, adamw], OLD)
    sd = model.state_dict()
    if layout == "list":  # modded-nanogpt: optimizers = [muon, adamw]
        return {"model": sd, "optimizers": [muon.state_dict(), adamw.state_dict()], "step": 4}
    if layout == "keys":
        return {"model": sd, "optimizer": muon.state_dict(), "optimizer_embed": adamw.state_dict(), "step": 4}
    # Lightning's layout of a module with two optimizers (`configure_optimizers` returning both)
    return {"state_dict": sd, "optimizer_states": [muon.state_dict(), adamw.state_dict()], "lr_schedulers": [],
            "epoch": 0, "global_step": 4, "pytorch-lightning_version": "2.6.6", "loops": {}, "callbacks": {}}


class WithQFormer(nn.Module):
    """An LM beside a Q-Former that has its own BERT word table (InstructBLIP's layout, its own tokenizer)."""

    def __init__(self, vocab: int, qvocab: int = 97):
        super().__init__()
        self.language_model = TinyLM(vocab, DIM)
        self.qformer = nn.Module()
        self.qformer.embeddings = nn.Module()
        self.qformer.embeddings.word_embeddings = nn.Embedding(qvocab, DIM)

    def forward(self, ids):
        return self.language_model(ids) + self.qformer.embeddings.word_embeddings(ids % 97).sum() * 0


class ExtraRows(nn.Module):
    """An embedding with 8 rows beyond the head's vocab (Mllama's cross-attention image tokens)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab + 8, DIM)
        self.lm_head = nn.Linear(DIM, vocab, bias=False)

    def forward(self, ids):
        return self.lm_head(self.embed_tokens(ids))


def _adamw_ckpt(model: nn.Module, **extra):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _steps(model, [opt], OLD)
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), **extra}


def _flat_buffer():
    model = TinyLM(OLD, DIM)
    ckpt = _adamw_ckpt(model)
    total = sum(p.numel() for p in model.parameters())
    ckpt["ema_flat"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # an EMA kept flat
    assert ckpt["ema_flat"].numel() == total
    return ckpt


# name -> (builder, paths inspect and repair must name, the finding code; None: states the plan itself refuses
# to remap (`ckptfix.optim_state`, issue 29), naming `--policy fresh`; with it they are dropped, and the
# audit says so; "changed": every optimizer is read (issue 29) and the audit finds each moment in the plan)
CASES = {
    "list-state": (lambda: _one_optimizer(ListStateSGD), ["optimizer.state.0.buffers[0]"], None),
    "nested-state": (lambda: _one_optimizer(NestedStateAdam), ["optimizer.state.0.moments.m"], None),
    "two-optimizers-list": (lambda: _two_optimizers("list"), ["optimizers[1].state.0.exp_avg"], "changed"),
    "two-optimizers-keys": (lambda: _two_optimizers("keys"), ["optimizer_embed.state.0.exp_avg"], "changed"),
    "lightning-optimizer-states": (lambda: _two_optimizers("lightning"), ["optimizer_states[1].state.0.exp_avg"],
                                   "changed"),
    "second-vocabulary": (lambda: _adamw_ckpt(WithQFormer(OLD), config={"qformer_config": {"vocab_size": 97},
                                                                         "text_config": {"vocab_size": OLD}}),
                          ["model.qformer.embeddings.word_embeddings.weight", "config.text_config.vocab_size"],
                          "handled"),
    "extra-rows": (lambda: _adamw_ckpt(ExtraRows(OLD), config={"vocab_size": OLD}), ["model.embed_tokens.weight"],
                   "handled"),
    "nested-text-config": (lambda: _adamw_ckpt(TinyLM(OLD, DIM), config={
        "model_type": "llava", "text_config": {"model_type": "llama", "vocab_size": OLD},
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": DIM}}),
        ["config.text_config.vocab_size"], "changed"),
    "nested-decoder": (lambda: _adamw_ckpt(TinyLM(OLD, DIM), config={
        "model_type": "vision-encoder-decoder", "decoder": {"model_type": "gpt2", "vocab_size": OLD},
        "encoder": {"model_type": "vit", "hidden_size": DIM}}),
        ["config.decoder.vocab_size"], "changed"),
    "flat-buffer": (_flat_buffer, ["ema_flat"], "CKF131"),
    "unnamed-integer": (lambda: _adamw_ckpt(TinyLM(OLD, DIM), args={"tokenizer_len": OLD, "max_steps": OLD}),
                        ["args.tokenizer_len"], "CKF132"),
}


# the states the plan refuses to remap, as its refusal and CKF210 name them (with their parameters)
REFUSED_STATES = {"list-state": "buffers[0]", "nested-state": "moments/m"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_sentencepiece(tmp_path_factory.mktemp("tok"), NEW, name=f"sp{NEW}")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("audit")
    out = {}
    for name, (build, _, _) in CASES.items():
        torch.manual_seed(0)
        out[name] = folder / f"{name}.pth"
        torch.save(build(), out[name])
    return out


def _cli(capsys, *args) -> tuple[int, str, str]:
    try:
        main([str(a) for a in args])
        status = 0
    except SystemExit as exc:
        status = int(exc.code or 0)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.parametrize("case", list(CASES))
def test_inspect_names_every_value_and_repair_refuses_naming_it(case, corpus, tokenizer, tmp_path, capsys):
    _, paths, code = CASES[case]
    report = ckptfix.inspect(corpus[case], tokenizer)
    if code is None:  # the plan itself refuses these states (issue 29: ckptfix.optim_state), naming them
        out = tmp_path / "out.pth"
        status, _, err = _cli(capsys, "repair", corpus[case], "-t", tokenizer, "-o", out)
        assert report.exit_code == 1 and status == 2 and "--policy fresh" in err and not out.exists(), err
        state = REFUSED_STATES[case]  # named by state and parameter, in inspect's CKF210 and in the refusal
        assert state in err and "text_embedding.weight" in err, err
        assert any(f.code == "CKF210" and state in f.message for f in report.findings), report.findings
        return
    named = {v["path"]: v for v in report.to_json()["audit"]["values"]}
    if code in ("changed", "handled"):  # handled: issue 30 (a separate vocabulary left alone; Mllama's offset)
        for path in paths:  # inspect names each: changed, or kept with its reason
            assert named[path]["status"] in (("changed",) if code == "changed" else ("changed", "kept")), named
        out = tmp_path / "out.pth"
        status, _, err = _cli(capsys, "repair", corpus[case], "-t", tokenizer, "-o", out)
        assert status == 0, err
        _assert_no_stale(out)
        LOADERS[case](torch.load(out, weights_only=True))  # its own classes load it and take a finite step
        return
    for path in paths:
        assert path in named, (path, sorted(named))
        found = [f for f in report.findings if f.code == code]
        assert found and any(path in f.tensors for f in found), [(f.code, f.message) for f in report.findings]
        assert named[path]["status"] == "unresolved"

    out = tmp_path / "out.pth"
    status, stdout, err = _cli(capsys, "repair", corpus[case], "-t", tokenizer, "-o", out, "--policy", "remap")
    assert status == 2, (stdout, err)
    assert all(path in err for path in paths), err
    assert "resolve:" in err and not out.exists()


def test_every_case_ends_right_or_refused_under_the_default_policy(corpus, tokenizer, tmp_path, capsys):
    """Default policy, no flags: exit 2, or exit 0 with nothing stale (loads and steps at the new vocab)."""
    outcomes = {}
    for case in CASES:
        out = tmp_path / f"{case}.pth"
        status, _, err = _cli(capsys, "repair", corpus[case], "-t", tokenizer, "-o", out)
        assert status in (0, 2), (case, err)
        if status == 0:
            _assert_no_stale(out)
        outcomes[case] = status
    assert outcomes == {c: 0 if CASES[c][2] in ("changed", "handled") else 2 for c in CASES}, outcomes


def _load_two_optimizers(sd: dict, layout: str) -> None:
    model = TinyLM(NEW, DIM)
    vocab, rest = _split(model)
    muon, adamw = torch.optim.SGD(rest, lr=1e-2, momentum=0.9), torch.optim.AdamW(vocab, lr=1e-3)
    model.load_state_dict(sd["state_dict" if layout == "lightning" else "model"], strict=True)
    states = {"list": lambda: sd["optimizers"], "keys": lambda: [sd["optimizer"], sd["optimizer_embed"]],
              "lightning": lambda: sd["optimizer_states"]}[layout]()  # Lightning restores each in this order
    muon.load_state_dict(states[0])
    adamw.load_state_dict(states[1])
    _steps(model, [muon, adamw], NEW, n=1)


def _load_adamw(model: nn.Module):
    def load(sd: dict) -> None:
        model.load_state_dict(sd["model"], strict=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt.load_state_dict(sd["optimizer"])
        _steps(model, [opt], NEW, n=1)
    return load


def _load_extra_rows(sd: dict) -> None:
    model = ExtraRows(NEW)
    assert sd["model"]["embed_tokens.weight"].shape[0] == NEW + 8 and sd["config"]["vocab_size"] == NEW
    _load_adamw(model)(sd)


def _load_nested(key: str):
    def load(sd: dict) -> None:
        assert sd["config"][key]["vocab_size"] == NEW
        _load_adamw(TinyLM(NEW, DIM))(sd)
    return load


# the repaired output of each case ckptfix handles, loaded as its training code would and stepped once
LOADERS = {
    "two-optimizers-list": lambda sd: _load_two_optimizers(sd, "list"),
    "two-optimizers-keys": lambda sd: _load_two_optimizers(sd, "keys"),
    "lightning-optimizer-states": lambda sd: _load_two_optimizers(sd, "lightning"),
    "second-vocabulary": lambda sd: _load_adamw(WithQFormer(NEW))(sd),
    "extra-rows": _load_extra_rows,
    "nested-text-config": _load_nested("text_config"),
    "nested-decoder": _load_nested("decoder"),
}


def _assert_no_stale(path: Path) -> None:
    """No tensor anywhere in the file still has the old row count."""
    def walk(node, where):
        if isinstance(node, torch.Tensor):
            assert OLD not in node.shape, where
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{where}.{k}")
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{where}[{i}]")
        elif isinstance(node, int) and not isinstance(node, bool):
            assert node != OLD, where

    sd = torch.load(path, weights_only=True)
    walk({k: v for k, v in sd.items() if k != "ckptfix"}, "")


@pytest.mark.parametrize("case, kind", [("nested-state", NestedStateAdam), ("list-state", ListStateSGD)])
def test_state_dropped_as_asked_loads_and_steps(corpus, tokenizer, tmp_path, case, kind):
    out = tmp_path / "fixed.pth"
    result = ckptfix.repair(corpus[case], tokenizer, out, policy="fresh")
    assert result.plan.drop_optimizer_state
    audited = {v.path: v for v in result.plan.audit.values}
    path = CASES[case][1][0]
    assert audited[path].status == "changed" and "dropped" in audited[path].reason
    sd = torch.load(out, weights_only=True)
    model = TinyLM(NEW, DIM)
    model.load_state_dict(sd["model"], strict=True)
    opt = kind(model.parameters())
    opt.load_state_dict(sd["optimizer"])
    _steps(model, [opt], NEW, n=1)


def test_keep_resolves_a_second_vocabulary(corpus, tokenizer, tmp_path):
    """--keep names the Q-Former's table: it stays as it is, its config entry too, the LM's vocab moves."""
    out = tmp_path / "fixed.pth"
    name = "qformer.embeddings.word_embeddings.weight"
    result = ckptfix.repair(corpus["second-vocabulary"], tokenizer, out, keep=[name, "config.qformer_config.vocab_size"])
    # kept: by --keep (listed as kept by the audit), or already left alone as a separate vocabulary (issue 30)
    assert name not in result.plan.weights
    sd, src = torch.load(out, weights_only=True), torch.load(corpus["second-vocabulary"], weights_only=True)
    assert torch.equal(sd["model"][name], src["model"][name])
    assert sd["config"] == {"qformer_config": {"vocab_size": 97}, "text_config": {"vocab_size": NEW}}
    model = WithQFormer(NEW)
    model.load_state_dict(sd["model"], strict=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.load_state_dict(sd["optimizer"])
    _steps(model, [opt], NEW, n=1)


def test_a_separate_vocabulary_is_one_answer_for_the_analysis_the_plan_and_the_audit(corpus, tokenizer, tmp_path):
    """`vocab.separate_tensors`: the Q-Former's table is no LM vocab tensor, the plan keeps it with the reason,
    and the audit reports it kept with the same reason (no flag needed)."""
    from ckptfix.formats import read_checkpoint
    from ckptfix.vocab import separate_tensors

    name = "qformer.embeddings.word_embeddings.weight"
    separate = separate_tensors(read_checkpoint(str(corpus["second-vocabulary"])))
    assert list(separate) == [name] and "config.qformer_config.vocab_size = 97" in separate[name]
    assert name not in {v.name for v in ckptfix.inspect(corpus["second-vocabulary"], tokenizer).vocab}
    result = ckptfix.repair(corpus["second-vocabulary"], tokenizer, tmp_path / "fixed.pth")
    assert result.plan.kept == separate
    audited = {v.path: v for v in result.plan.audit.values}
    assert (audited[f"model.{name}"].status, audited[f"model.{name}"].reason) == ("kept", separate[name])


def test_counter_equal_by_chance_is_kept_with_its_reason(corpus, tokenizer, tmp_path):
    out = tmp_path / "fixed.pth"
    result = ckptfix.repair(corpus["unnamed-integer"], tokenizer, out, keep=["args.tokenizer_len"])
    by_path = {v.path: v for v in result.plan.audit.values}
    assert by_path["args.max_steps"].status == "kept" and "by chance" in by_path["args.max_steps"].reason
    assert by_path["args.tokenizer_len"].status == "kept" and "--keep" in by_path["args.tokenizer_len"].reason


# -- VLM: nested text_config, transformers' own classes --------------------------------------------------


def test_llava_text_config_is_written_or_refused(tokenizer, tmp_path, capsys):
    """LLaVA's vocab size lives in config.text_config: repair must write it where the model class reads it, or
    refuse; verify turns an output whose config.json still holds the old size into exit 3, OUT removed."""
    transformers = pytest.importorskip("transformers")
    text = transformers.LlamaConfig(vocab_size=OLD, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    vision = transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=28, patch_size=14, projection_dim=16)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=OLD - 1)
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config)
    src = tmp_path / "llava"
    model.save_pretrained(src)
    assert json.loads((src / "config.json").read_text())["text_config"]["vocab_size"] == OLD

    report = ckptfix.inspect(src, tokenizer)
    assert any("text_config" in json.dumps(f.to_json()) or f.code == "CKF115" for f in report.findings) \
        or report.exit_code == 1
    out = tmp_path / "fixed"
    status, stdout, err = _cli(capsys, "repair", src, "-t", tokenizer, "-o", out)
    assert status == 0, err  # issue 30: the nested size is written where LlavaConfig reads it
    if status == 0:
        written = json.loads((out / "config.json").read_text())
        assert written["text_config"]["vocab_size"] == NEW
        transformers.LlavaForConditionalGeneration.from_pretrained(out)
    else:
        assert not out.exists() and "text_config.vocab_size" in err, err


def test_the_guard_refuses_a_resize_that_leaves_a_flat_buffer_stale(corpus):
    """ResumeGuard(policy="remap") resizes in memory through the same plan and audit: the flat EMA buffer the
    checkpoint keeps beside the model would come back at the old length, so load raises, naming it."""
    from ckptfix.guard.resume import ResumeError

    model = TinyLM(NEW, DIM)
    guard = ckptfix.ResumeGuard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), policy="remap", tokenizer=NEW)
    with pytest.raises(ResumeError, match=r"ema_flat"):
        guard.load(corpus["flat-buffer"])


def _with_extras(tmp_path, name, extras):
    model = TinyLM(OLD, DIM)
    path = tmp_path / name
    torch.save({"model": model.state_dict(), **extras}, path)
    return path


def _dag_checkpoint(tmp_path) -> Path:
    """A dict shared 2**25 ways as a tree (built here, not in the test: a failing test's traceback would
    print the test's locals, and the repr of a DAG expands it)."""
    dag: dict = {"leaf": 7}
    for _ in range(25):
        dag = {"a": dag, "b": dag}
    return _with_extras(tmp_path, "dag.pth", {"meta": dag})


def _deep_checkpoint(tmp_path, depth: int) -> Path:
    deep: dict = {"vocab_size_somewhere": OLD}
    for _ in range(depth):
        deep = {"x": deep}
    return _with_extras(tmp_path, "deep.pth", {"meta": deep})


def test_a_memo_shared_dag_is_walked_once_and_a_deep_tree_is_refused_not_kept(tmp_path, tokenizer):
    """Bounded work (SECURITY.md): a dict shared 2**25 ways as a tree is visited once per container; a tree
    deeper than the audit's bound is unresolved (what lies past it was not checked), never kept."""
    import time

    from ckptfix.audit import MAX_DEPTH

    path = _dag_checkpoint(tmp_path)
    start = time.process_time()
    ckptfix.repair(path, tokenizer, tmp_path / "dag.fixed.pth")
    assert time.process_time() - start < 20

    path = _deep_checkpoint(tmp_path, MAX_DEPTH + 4)
    with pytest.raises(ckptfix.RepairError, match="past the audit's bound"):
        ckptfix.repair(path, tokenizer, tmp_path / "deep.fixed.pth")
