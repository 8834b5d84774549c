"""Sharded saves (torch.distributed.checkpoint): how the checkpoint was split, and ties DCP hides."""

from __future__ import annotations

from collections.abc import Iterator

from ckptfix.checks.codes import Context, Finding, check, finding


def _layout(ctx: Context):
    from ckptfix.formats.dcp_folder import DcpLayout

    raw = ctx.ckpt.raw
    return raw if ctx.ckpt.format == "dcp" and isinstance(raw, DcpLayout) else None


def _chunking(layout, fqn: str) -> str:
    item = layout.items.get(fqn)
    if item is None or len(item.pieces) <= 1:
        return "1 piece"
    dims = {d for offsets, _ in item.pieces for d, o in enumerate(offsets) if o}
    along = ", ".join(f"dim {d}" for d in sorted(dims)) or "no dim"
    d = min(dims) if dims else 0
    spans = [f"[{o[d]}:{o[d] + s[d]}]" for o, s in item.pieces[:4]]
    return f"{len(item.pieces)} pieces along {along} ({', '.join(spans)}{', ...' if len(item.pieces) > 4 else ''})"


@check("CKF720", "info", "sharded save: world size and vocab chunking",
       "A DCP folder written by several ranks: how many, and how each vocab tensor is split into pieces. "
       "repair reads the pieces offline and writes a folder that loads at any world size.")
def sharded_save(ctx: Context) -> Iterator[Finding]:
    layout = _layout(ctx)
    if layout is None:
        return
    vocab = [v for v in ctx.vocab if v.tied_to is None]
    split = [v for v in vocab if _pieces(layout, v.name) > 1]
    if layout.world_size <= 1 and not split:
        return
    parts = [f"{v.name} {_chunking(layout, layout.model_items.get(v.name, ''))}" for v in vocab]
    yield finding("CKF720", f"saved by {layout.world_size} rank(s) ({len(layout.data_files)} data file(s)); "
                  + ("; ".join(parts) if parts else "no vocab tensor found"),
                  pytorch="dcp.load reshards on load (any world size) but cannot resize a tensor.",
                  fix="To change the vocab, `ckptfix repair` reads the pieces offline, in one process.")


@check("CKF721", "info", "tied head in a DCP save",
       "DCP writes a tied head as its own copy of the embedding (both names, identical bytes) and the "
       "optimizer keeps state for one of them: ckptfix reports them tied and resizes them together.")
def dcp_tied(ctx: Context) -> Iterator[Finding]:
    layout = _layout(ctx)
    if layout is None:
        return
    for alias, first in sorted(ctx.ckpt.tied.items()):
        yield finding("CKF721", f"{alias} is saved as a copy of {first} (identical pieces, no optimizer state of "
                      "its own): a tied head", pytorch="set_state_dict re-ties them on load.",
                      fix="Nothing to do; repair writes both names with the same rows.")


def _pieces(layout, name: str) -> int:
    item = layout.items.get(layout.model_items.get(name, ""))
    return len(item.pieces) if item is not None else 0
