"""Count the collectives one rank issues, to compare ranks: a guard path that issues a different number of
collectives on different ranks hangs the run in its next one.

`Collectives()` as a context records, in order, every call of

- `torch.distributed`'s collective functions (what DTensor's `torch.equal`, FSDP2 and the guard call);
- the functional collectives (`torch.distributed._functional_collectives`) DTensor redistributes with
  (`full_tensor()`, a Partial reduced by `.item()`);
- any c10d op that reaches the dispatcher outside a tensor subclass (a TorchDispatchMode: it does not see
  what DTensor issues inside its own dispatch, which is why the functions above are patched too).

The patches are plain attribute swaps undone on exit; the calls themselves run unchanged.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode

_C10D = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_object",
         "all_gather_coalesced", "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "reduce",
         "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list",
         "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv")
_FUNCOL_PREFIXES = ("all_", "reduce_scatter", "broadcast", "permute_tensor")
_OP_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")


class _Ops(TorchDispatchMode):
    def __init__(self, calls: list[str]):
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in _OP_NAMESPACES:
            self.calls.append(f"op:{func}")
        return func(*args, **(kwargs or {}))


class Collectives:
    """`with Collectives() as c: ...` then `c.calls`: the collectives issued inside, in order.

    `dry=True` records `torch.distributed`'s calls without communicating (each returns None, an in-place
    all_reduce leaves the local value): how a test shows a data-dependent pattern's per-rank counts without
    hanging in it."""

    def __init__(self, dry: bool = False) -> None:
        self.dry = dry
        self.calls: list[str] = []
        self._undo: list[tuple[object, str, object]] = []
        self._mode = _Ops(self.calls)

    def _wrap(self, module: object, name: str, label: str) -> None:
        original = getattr(module, name, None)
        if not callable(original):
            return

        def counted(*args, **kwargs):
            self.calls.append(label)
            if self.dry and module is not funcol:
                return None
            return original(*args, **kwargs)

        self._undo.append((module, name, original))
        setattr(module, name, counted)

    def __enter__(self) -> Collectives:
        for name in _C10D:
            # both spellings: `dist.x` (DTensor, FSDP2) and `distributed_c10d.x` (its own helpers) are looked up apart
            self._wrap(dist, name, f"dist.{name}")
            self._wrap(c10d, name, f"c10d.{name}")
        for name in dir(funcol):
            if name.startswith(_FUNCOL_PREFIXES):
                self._wrap(funcol, name, f"funcol.{name}")
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for module, name, original in reversed(self._undo):
            setattr(module, name, original)
        self._undo.clear()


def count(fn, *args, dry: bool = False, **kwargs) -> tuple[object, list[str]]:
    """`fn(*args, **kwargs)` and the collectives it issued on this rank."""
    with Collectives(dry) as c:
        out = fn(*args, **kwargs)
    return out, list(c.calls)


__all__ = ["Collectives", "count"]
