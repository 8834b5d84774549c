"""The live training objects as plain data: what `plan_resume` needs to know of them.

`Live.capture(model, optimizer, scheduler, scaler, tokenizer_size)` reads shapes, dtypes and
identities from the torch objects; a test builds a `Live` by hand to check a decision without a
model. Identities (`ident`, the id() of the live tensor) tell tied aliases apart from copies and
find a model tensor's position in the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LiveTensor:
    """One tensor of the live model (a `state_dict(keep_vars=True)` entry) or optimizer."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"  # torch's name without "torch."
    ident: int = 0  # equal for tied aliases of one tensor
    is_param: bool = True

    @property
    def is_float32_or_wider(self) -> bool:
        return self.dtype in ("float32", "float64")


@dataclass
class Live:
    """What the guard was given, as data. `optimizer`: the live optimizer's parameters per group
    (None: no optimizer); `model_order`: parameter identities in `named_parameters()` order."""

    state: dict[str, LiveTensor] = field(default_factory=dict)
    model_order: list[int] = field(default_factory=list)
    optimizer: list[list[LiveTensor]] | None = None
    has_scheduler: bool = False
    scaler_enabled: bool = False
    has_scaler: bool = False
    tokenizer_size: int | None = None
    embedding: tuple[str, int] | None = None  # the input embedding's name and row count
    # The tokenizers as id -> token tables (TokenizerInfo), when the guard was given paths or TokenizerInfos:
    # rows then move by token string (from `from_tokenizer`, else the checkpoint's record or folder).
    tokenizer: Any = None
    from_tokenizer: Any = None
    keep_ids: bool = False  # rows stay at their id even where the old tokenizer is known (`repair --keep-ids`)

    @property
    def optimizer_params(self) -> list[LiveTensor]:
        return [p for group in self.optimizer or [] for p in group]

    @property
    def layout(self) -> list[int]:
        return [len(group) for group in self.optimizer or []]

    def follows_model_order(self) -> bool:
        """The live optimizer holds the model's parameters in the model's order."""
        order = {ident: i for i, ident in enumerate(self.model_order)}
        seq = [order.get(p.ident, -1) for p in self.optimizer_params]
        return -1 not in seq and all(a < b for a, b in zip(seq, seq[1:]))

    @classmethod
    def capture(cls, model: Any, optimizer: Any = None, scheduler: Any = None, scaler: Any = None,
                tokenizer_size: int | None = None) -> Live:
        from ckptfix.guard.setup import named_params, scaler_enabled, unwrap_optimizer

        params = named_params(model)
        param_ids = {id(p) for p in model.parameters()}
        state = {k: _tensor(k, t, id(t) in param_ids) for k, t in model.state_dict(keep_vars=True).items()}
        names = {id(p): n for n, p in params.items()}
        groups = None
        if optimizer is not None:
            opt = unwrap_optimizer(optimizer)
            groups = [[_tensor(names.get(id(p), f"<unnamed {list(p.shape)}>"), p, True) for p in g["params"]]
                      for g in opt.param_groups]
        return cls(state=state, model_order=[id(p) for p in params.values()], optimizer=groups,
                   has_scheduler=scheduler is not None, scaler_enabled=scaler_enabled(scaler),
                   has_scaler=scaler is not None, tokenizer_size=tokenizer_size,
                   embedding=_embedding(model) if tokenizer_size is not None else None)


def _tensor(name: str, t: Any, is_param: bool) -> LiveTensor:
    return LiveTensor(name, tuple(t.shape), str(t.dtype).replace("torch.", ""), id(t), is_param)


def _embedding(model: Any) -> tuple[str, int] | None:
    """The model's input embedding weight: HF's accessor, else by name, else the largest."""
    import torch

    from ckptfix.vocab import EMBEDDING_NAMES

    names = {id(p): n for n, p in model.named_parameters()}
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            weight = getattr(get(), "weight", None)
        except (NotImplementedError, AttributeError):
            weight = None
        if isinstance(weight, torch.Tensor) and id(weight) in names:
            return names[id(weight)], weight.shape[0]
    embeddings = [(names.get(id(m.weight), f"{n}.weight"), m.weight.shape[0])
                  for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)]
    pool = [e for e in embeddings if EMBEDDING_NAMES.search(e[0])] or embeddings
    return max(pool, key=lambda e: e[1]) if pool else None
