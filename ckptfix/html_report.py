"""`inspect --html` and `diff --html`: one self-contained HTML page (inline CSS and SVG, no script, nothing
loaded from anywhere) with the rows of the vocab tensors drawn along the token ids.

The page is built from untrusted input: every string from the checkpoint or the tokenizer (tensor names, token
text, paths, finding messages that quote them) passes `_text` (control characters shown escaped, then
`html.escape`). Row numbers come from `row_stats` in bounded chunks. The file is written only to the path named,
whole or not at all (`write_page`).
"""

from __future__ import annotations

import html
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

from ckptfix.checkpoint import Checkpoint, TensorInfo
from ckptfix.errors import CkptfixError, RepairError
from ckptfix.io import atomic_new, atomic_write, check_output_path, same_file
from ckptfix.mapping import map_optimizer
from ckptfix.optim_state import SECOND, rule_for
from ckptfix.row_stats import Buckets, buckets, readable_rows, row_changes, row_means_and_zeros, row_norms
from ckptfix.untrusted import escape
from ckptfix.vocab import VocabTensor, find_vocab_tensors

if TYPE_CHECKING:
    from ckptfix.compare import DiffReport, TensorDiff
    from ckptfix.inspect import Report
    from ckptfix.tokenizer_info import TokenizerInfo

# Chart geometry (px). The page's left padding is PAGE_LEFT, so a row's x on the page is known (the tests read
# screenshots with it).
PAGE_LEFT = 20
WIDTH, LEFT, RIGHT, TOP, PLOT_H, STRIP_H, BOTTOM = 1100, 80, 12, 12, 170, 12, 30
PLOT_W = WIDTH - LEFT - RIGHT
MAX_BARS = 300  # tensors drawn one bar each; more are drawn one range per layer
MAX_LISTED = 200  # rows listed in a table under a chart
LINE = "#1f4e89"


@dataclass(frozen=True)
class Region:
    code: int  # a bucket shows its largest code: the rarer categories have the larger codes
    color: str
    label: str


BASE, ADDED, SPECIAL, OWN, PADDING, NEVER = (
    Region(0, "#c6dbef", "base vocabulary"), Region(1, "#31a354", "added tokens"),
    Region(2, "#9e67c9", "special / reserved tokens"), Region(3, "#a0522d", "the model's own rows (past the vocab)"),
    Region(4, "#9a9a9a", "padding rows past the tokenizer"), Region(5, "#e6194b", "never trained (a token's exp_avg_sq row exactly 0)"))
NEVER_TRAINED_COLOR = NEVER.color
ROWS = Region(0, "#c6dbef", "rows (no --tokenizer given)")
OLD_ROW, NEW_ROW, NOT_IN_A, STILL = (
    Region(0, "#c6dbef", "rows in both"), Region(1, "#31a354", "new tokens' rows"),
    Region(2, "#17becf", "rows past A's row count (no row in A)"), Region(5, "#e6194b", "did not move (change exactly 0)"))
_RESERVED = re.compile(r"reserved|^\[unused\d+\]$|^<unused\d+>$|^<extra_id_\d+>$", re.I)

CSS = """
body{margin:0;padding:16px 20px;font:14px/1.4 system-ui,sans-serif;color:#222;background:#fff}
h1{font-size:20px;margin:0 0 8px}h2{font-size:17px;margin:22px 0 6px}h3{font-size:15px;margin:14px 0 4px}
pre{background:#f6f6f6;padding:8px;white-space:pre-wrap;word-break:break-all;font-size:12px;max-width:1100px}
table{border-collapse:collapse;font-size:12px;max-width:1100px}td,th{border:1px solid #ddd;padding:3px 6px;
text-align:left;vertical-align:top}th{background:#f0f0f0}.chart{display:block;max-width:none}
.error td:first-child{color:#b00020;font-weight:bold}.warning td:first-child{color:#a05a00;font-weight:bold}
.legend span{display:inline-block;margin-right:14px}.sw{display:inline-block;width:11px;height:11px;
margin-right:4px;vertical-align:-1px}.note{color:#555;font-size:12px;max-width:1100px}code{word-break:break-all}
"""


def _text(value: Any, limit: int | None = None) -> str:
    """Untrusted text for the page: control characters shown escaped, then HTML-escaped (quotes too)."""
    return html.escape(escape(value, limit), quote=True)


def _page(title: str, body: Iterable[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_text(title)}</title><style>{CSS}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


# -- charts ------------------------------------------------------------------------------------------------


@dataclass
class _Scale:
    lo: float
    hi: float
    log: bool

    def y(self, v: float) -> float:
        if self.log:
            t = 0.0 if v <= 0 else (math.log10(v) - math.log10(self.lo)) / (math.log10(self.hi) - math.log10(self.lo))
        else:
            t = (v - self.lo) / (self.hi - self.lo)
        return TOP + PLOT_H * (1 - min(max(t, 0.0), 1.0))

    def ticks(self) -> list[float]:
        if not self.log:
            return [self.lo + (self.hi - self.lo) * i / 4 for i in range(5)]
        first, last = math.ceil(math.log10(self.lo) - 1e-9), math.floor(math.log10(self.hi) + 1e-9)
        step = max(1, (last - first) // 6 + 1)
        return [10.0 ** e for e in range(first, last + 1, step)]


def _scale(low: np.ndarray, high: np.ndarray, log: bool) -> _Scale:
    finite = np.concatenate([low[np.isfinite(low)], high[np.isfinite(high)]])
    if log:
        positive = finite[finite > 0]
        if not positive.size:
            return _Scale(0.1, 1.0, True)
        lo, hi = 10.0 ** math.floor(math.log10(positive.min())), 10.0 ** math.ceil(math.log10(positive.max()))
        return _Scale(lo, hi if hi > lo else lo * 10, True)
    hi = float(finite.max()) if finite.size else 1.0
    lo = min(0.0, float(finite.min())) if finite.size else 0.0
    return _Scale(lo, hi if hi > lo else lo + 1.0, False)


def _x(position: float, count: int) -> float:
    return LEFT + PLOT_W * position / max(count, 1)


def _y_axis(scale: _Scale) -> list[str]:
    out = [f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + PLOT_H}" stroke="#888"/>']
    for v in scale.ticks():
        y = scale.y(v)
        out.append(f'<line x1="{LEFT - 4}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" stroke="#eee"/>'
                   f'<text x="{LEFT - 6}" y="{y + 4:.1f}" font-size="11" text-anchor="end">{v:.3g}</text>')
    return out


def _x_axis(labels: Sequence[int], count: int) -> list[str]:
    """Five ticks along the buckets, each labelled with its row's id."""
    y = TOP + PLOT_H + STRIP_H + 4
    out = []
    positions = sorted({min(count - 1, round(i * (count - 1) / 4)) for i in range(5)} if count > 1 else {0})
    for pos in positions:
        x = _x(pos + 0.5, count)
        anchor = "start" if x < LEFT + 20 else ("end" if x > WIDTH - RIGHT - 20 else "middle")
        out.append(f'<text x="{x:.1f}" y="{y + 12}" font-size="11" text-anchor="{anchor}">{labels[pos]:,}</text>')
    out.append(f'<text x="{WIDTH - RIGHT}" y="{y + 24}" font-size="11" text-anchor="end">token id</text>')
    return out


def _bucket_path(b: Buckets, scale: _Scale) -> str:
    """One vertical stroke per bucket from its min to its max (at least a pixel, so a flat bucket shows)."""
    width = min(3.0, max(1.0, 0.8 * PLOT_W / max(b.count, 1)))
    strokes, prev = [], None
    for k in range(b.count):
        low, high = float(b.low[k]), float(b.high[k])
        if not math.isfinite(low):
            prev = None
            continue
        reach = (low, high) if prev is None else (min(low, prev[1]), max(high, prev[0]))  # joined to the last bucket
        x, y1, y2 = _x(k + 0.5, b.count), scale.y(reach[1]), scale.y(reach[0])
        strokes.append(f"M{x:.1f} {y1:.1f}V{max(y2, y1 + 1):.1f}")
        prev = (low, high)
    dots = [f'<circle cx="{_x(k + 0.5, b.count):.1f}" cy="{scale.y(float(b.high[k])):.1f}" r="2.5" fill="{LINE}"/>'
            for k in range(b.count) if b.count <= 200 and math.isfinite(b.high[k])]  # few rows: each one a dot too
    return f'<path d="{"".join(strokes)}" stroke="{LINE}" stroke-width="{width:.1f}" fill="none"/>' + "".join(dots)


def _strip(codes: np.ndarray, colors: dict[int, str], count: int) -> list[str]:
    """The regions under the plot: runs of buckets with one code as one rectangle each (at least 2 px wide)."""
    y, out, start = TOP + PLOT_H + 2, [], 0
    for k in range(1, count + 1):
        if k == count or codes[k] != codes[start]:
            x0, x1 = _x(start, count), _x(k, count)
            width = max(x1 - x0, 2.0)
            out.append(f'<rect x="{x0:.1f}" y="{y}" width="{width:.1f}" height="{STRIP_H}" '
                       f'fill="{colors[int(codes[start])]}"/>')
            start = k
    return out


def row_chart(values: np.ndarray, codes: np.ndarray, regions: Sequence[Region], *, log: bool, label: str,
              ids: np.ndarray | None = None) -> str:
    """An SVG of per-row `values` (one row per token id, or the rows `ids` names) as per-bucket min/max strokes,
    with the regions of `codes` (one per row) in a strip under the plot."""
    b = buckets(values)
    height = TOP + PLOT_H + STRIP_H + BOTTOM
    parts = [f'<svg class="chart" width="{WIDTH}" height="{height}" '
             f'viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{_text(label)}">',
             f'<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="#fff"/>']
    if not b.count:
        return parts[0] + '<text x="10" y="20">no rows</text></svg>'
    scale = _scale(b.low, b.high, log)
    parts += _y_axis(scale)
    parts.append(_bucket_path(b, scale))
    parts += _strip(b.most(codes), {r.code: r.color for r in regions}, b.count)
    labels = ids[b.edges[:-1]] if ids is not None else b.edges[:-1]
    parts += _x_axis([int(v) for v in labels], b.count)
    parts.append("</svg>")
    return "".join(parts)


def legend(codes: np.ndarray, regions: Sequence[Region]) -> str:
    counts = np.bincount(codes, minlength=max(r.code for r in regions) + 1)
    items = [f'<span><i class="sw" style="background:{r.color}"></i>{html.escape(r.label)}: {int(counts[r.code]):,}</span>'
             for r in regions if counts[r.code]]
    return f'<div class="legend">{"".join(items)}</div>'


# -- inspect --------------------------------------------------------------------------------------------------


def inspect_page(report: Report) -> str:
    """The HTML page of an inspect report: summary, findings, and each vocab tensor's rows."""
    from ckptfix.render import render_report

    summary = render_report(report).split("\nfindings: ")[0]
    counts = report.counts()
    body = [f"<h1>ckptfix inspect: {_text(report.ckpt.path)}</h1>", "<h2>Summary</h2>", f"<pre>{_text_lines(summary)}</pre>",
            f"<h2>Findings: {counts['error']} error(s), {counts['warning']} warning(s), {counts['info']} info</h2>",
            findings_table(report.findings), "<h2>Vocab rows along the token ids</h2>"]
    body += vocab_sections(report)
    return _page(f"ckptfix inspect {report.ckpt.path}", body)


def _text_lines(text: str) -> str:
    return "\n".join(_text(line) for line in text.split("\n"))


def findings_table(findings: Sequence[Any]) -> str:
    if not findings:
        return "<p>No findings.</p>"
    rows = ["<table><tr><th>severity</th><th>code</th><th>finding</th><th>fix</th></tr>"]
    for f in findings:
        tensors = f"<br><small>tensors: {_text(', '.join(f.tensors[:8]))}</small>" if f.tensors else ""
        fix = f"<code>{_text(f.fix)}</code>" if f.fix else ""
        rows.append(f'<tr class="{_text(f.severity)}"><td>{_text(f.severity)}</td><td>{_text(f.code)}</td>'
                    f"<td><b>{_text(f.title)}</b><br>{_text(f.message)}{tensors}</td><td>{fix}</td></tr>")
    return "".join(rows) + "</table>"


def second_moment(report: Report, v: VocabTensor) -> TensorInfo | None:
    """The vocab tensor's second moment (Adam's exp_avg_sq: one value per element, same shape)."""
    kind = report.ckpt.optimizer.kind_of(v.optimizer_index) if report.ckpt.optimizer is not None else None
    for key, t in v.moments.items():
        if t.shape == v.shape and readable_rows(t) and (rule_for(kind, key) is SECOND or key.endswith("exp_avg_sq")):
            return t
    return None


def vocab_sections(report: Report) -> list[str]:
    out = []
    for v in report.vocab:
        tensor = report.ckpt.model.get(v.name)
        if v.role not in ("embedding", "head") or tensor is None or not readable_rows(tensor):
            continue
        if v.tied_to:
            out.append(f"<h3>{_text(v.name)}</h3><p class=\"note\">tied to {_text(v.tied_to)}: the same rows.</p>")
            continue
        out += tensor_section(report, v, tensor)
    return out or ['<p class="note">No embedding or head found (no 2-D float tensor with the vocab\'s rows).</p>']


def tensor_section(report: Report, v: VocabTensor, tensor: TensorInfo) -> list[str]:
    """One vocab tensor: its row norms and its second moment's row means, the regions marked under each."""
    norms = row_norms(tensor)
    moment = second_moment(report, v)
    means, never = row_means_and_zeros(moment) if moment is not None else (None, None)
    tok = report.tokenizer
    codes, regions = row_regions(len(norms), v.token_rows, tok, never)
    out = [f"<h3>{_text(v.name)} ({_text(v.role)}, {len(norms):,} rows x {tensor.shape[1]:,})</h3>",
           f"<p class=\"note\">L2 norm of each row{_bucket_note(len(norms))}.</p>",
           row_chart(norms, codes, regions, log=False, label=f"{v.name} row norms"), legend(codes, regions)]
    if means is not None and never is not None:
        out += [f"<p class=\"note\">Second moment (exp_avg_sq) row means, log scale; a row exactly 0 never had a "
                f"gradient: {int(never.sum()):,} such row(s).</p>",
                row_chart(means, codes, regions, log=True, label=f"{v.name} exp_avg_sq row means"), legend(codes, regions)]
    else:
        out.append('<p class="note">No second moment (exp_avg_sq) saved for this tensor.</p>')
    out.append(rows_table(codes, norms, means, tok))
    return out


def _bucket_note(rows: int) -> str:
    return "" if rows <= 2000 else f"; {rows:,} rows drawn as 2,000 buckets, each stroke from its min to its max"


def row_regions(rows: int, token_rows: int, tok: TokenizerInfo | None,
                never: np.ndarray | None) -> tuple[np.ndarray, list[Region]]:
    """Each row's region code, and the regions drawn: the tokenizer's base, added, special/reserved ids, padding
    past it, the model's own rows past the vocab, and rows whose exp_avg_sq is exactly 0 (drawn over the others)."""
    codes = np.zeros(rows, np.uint8)
    if tok is not None:
        ids = min(tok.size, token_rows, rows)
        codes[min(tok.base_size, ids):ids] = ADDED.code
        for token_id, _content, special in tok.added_tokens:
            if token_id < ids:
                codes[token_id] = SPECIAL.code if special else ADDED.code
        for token_id in special_ids(tok, ids):
            codes[token_id] = SPECIAL.code
        codes[min(tok.size, token_rows, rows):token_rows] = PADDING.code
    codes[token_rows:] = OWN.code
    if never is not None:  # with a tokenizer, only rows a token id reaches: padding is never trained by design
        reached = np.zeros(rows, bool)
        reached[:min(tok.size, token_rows, rows) if tok is not None else rows] = True
        codes[never[:rows] & reached] = NEVER.code
    first = BASE if tok is not None else ROWS
    return codes, [first, ADDED, SPECIAL, OWN, PADDING, NEVER]


def special_ids(tok: TokenizerInfo, ids: int) -> list[int]:
    """Ids of the tokenizer's special tokens and of tokens named as reserved (`<|reserved_special_token_3|>`,
    `[unused7]`, `<extra_id_0>`)."""
    named = set(tok.special_tokens)
    table = tok.id_to_token()
    return [i for i, t in enumerate(table[:ids]) if t is not None and (t in named or _RESERVED.search(t))]


_LISTED = {ADDED.code: "added", SPECIAL.code: "special/reserved", NEVER.code: "never trained"}


def rows_table(codes: np.ndarray, norms: np.ndarray, means: np.ndarray | None, tok: TokenizerInfo | None) -> str:
    """The added, special/reserved and never-trained rows (the first MAX_LISTED), with their token text."""
    listed = np.flatnonzero(np.isin(codes, list(_LISTED)))
    if not listed.size:
        return ""
    table = tok.id_to_token() if tok is not None else []
    rows = ["<table><tr><th>id</th><th>region</th><th>token</th><th>row norm</th><th>exp_avg_sq row mean</th></tr>"]
    for i in listed[:MAX_LISTED]:
        token = table[i] if i < len(table) else None
        mean = f"{means[i]:.3g}" if means is not None else ""
        rows.append(f"<tr><td>{i}</td><td>{_LISTED[int(codes[i])]}</td><td><code>{_text(token, 80) if token is not None else ''}"
                    f"</code></td><td>{norms[i]:.4g}</td><td>{mean}</td></tr>")
    more = f"<p class=\"note\">... and {listed.size - MAX_LISTED:,} more.</p>" if listed.size > MAX_LISTED else ""
    return "".join(rows) + "</table>" + more


# -- diff -------------------------------------------------------------------------------------------------------


def diff_page(report: DiffReport, ca: Checkpoint, cb: Checkpoint, tokenizer: TokenizerInfo | None = None) -> str:
    """The HTML page of a diff: the relative update of each tensor by layer, and the new tokens' rows."""
    data = report.to_json()
    head = [f"<tr><th>{k.upper()}</th><td>{_text(data[k]['path'])} ({_text(data[k]['format'])}, "
            f"{'unknown step' if data[k]['step'] is None else 'step ' + format(data[k]['step'], 'g')})</td></tr>" for k in "ab"]
    head += [f"<tr><th>trainable</th><td>{_text(data['summary_line'])}</td></tr>",
             f"<tr><th>verdict</th><td>{_text(data['verdict'])}</td></tr>"]
    body = [f"<h1>ckptfix diff: {_text(ca.path)} -> {_text(cb.path)}</h1>", f"<table>{''.join(head)}</table>",
            "<h2>Relative update ||B - A|| / ||A|| per tensor, by layer</h2>", update_chart(report.tensors),
            other_tensors(report.tensors), "<h2>New tokens' rows</h2>"]
    body += new_row_sections(ca, cb, tokenizer, learned_ids(report))
    body += [f'<p class="note">note: {_text(n)}</p>' for n in data["notes"]]
    return _page(f"ckptfix diff {ca.path} {cb.path}", body)


def layer_of(name: str) -> str:
    """The layer a tensor belongs to: its name up to the first numeric part (`model.layers.3`), else its module."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1]) or name


def update_chart(tensors: Sequence[TensorDiff]) -> str:
    """Horizontal bars on a log scale, one per compared tensor grouped by layer (one min-max range per layer
    with a median tick where there are more than MAX_BARS tensors)."""
    compared = [t for t in tensors if t.status in ("changed", "unchanged") and t.rel_change is not None]
    if not compared:
        return '<p class="note">No tensor of the same shape in both checkpoints.</p>'
    groups: dict[str, list[TensorDiff]] = {}
    for t in compared:
        groups.setdefault(layer_of(t.name), []).append(t)
    values = np.array([t.rel_change for t in compared], dtype=np.float64)
    scale = _bar_scale(values)
    lines = _layer_bars(groups, scale) if len(compared) > MAX_BARS else _tensor_bars(groups, scale)
    height = 26 + 16 * len(lines) + 20
    axis = _bar_axis(scale, height)
    body = "".join(svg for svg in (f'<g transform="translate(0,{26 + 16 * i})">{line}</g>' for i, line in enumerate(lines)))
    return (f'<svg class="chart" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" role="img" aria-label="relative update per tensor">'
            f'<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="#fff"/>{axis}{body}</svg>'
            '<p class="note">Blue: a trainable tensor; light blue: not trainable; red: a trainable tensor that did not '
            "change. A bar's length is log10 of ||B - A|| / ||A||.</p>")


BAR_LEFT = 360
BAR_W = WIDTH - BAR_LEFT - RIGHT


def _bar_scale(values: np.ndarray) -> _Scale:
    positive = values[np.isfinite(values) & (values > 0)]
    if not positive.size:
        return _Scale(1e-3, 1.0, True)
    lo, hi = 10.0 ** math.floor(math.log10(positive.min())), 10.0 ** math.ceil(math.log10(positive.max()))
    return _Scale(lo / 10, hi if hi > lo else lo * 10, True)


def _bar_x(scale: _Scale, v: float) -> float:
    if not v > 0:
        return BAR_LEFT
    t = 1.0 if math.isinf(v) else (math.log10(v) - math.log10(scale.lo)) / (math.log10(scale.hi) - math.log10(scale.lo))
    return BAR_LEFT + BAR_W * min(max(t, 0.0), 1.0)


def _bar_axis(scale: _Scale, height: int) -> str:
    out = []
    for v in scale.ticks():
        x = _bar_x(scale, v)
        anchor = "end" if x > WIDTH - RIGHT - 20 else "middle"
        out.append(f'<line x1="{x:.1f}" y1="20" x2="{x:.1f}" y2="{height - 16}" stroke="#eee"/>'
                   f'<text x="{x:.1f}" y="14" font-size="11" text-anchor="{anchor}">{v:.0e}</text>')
    return "".join(out)


def _tensor_bars(groups: dict[str, list[TensorDiff]], scale: _Scale) -> list[str]:
    lines = []
    for layer, members in groups.items():
        lines.append(f'<text x="4" y="12" font-size="12" font-weight="bold">{_text(layer, 60)}</text>')
        for t in members:
            value = float(t.rel_change) if t.rel_change is not None else 0.0
            color = "#e6194b" if t.trainable and t.status == "unchanged" else ("#3b75af" if t.trainable else "#9ecae1")
            x = _bar_x(scale, value)
            shown = f"{value:.3g}" if t.status == "changed" else "unchanged"
            lines.append(f'<title>{_text(t.name)}</title><text x="16" y="12" font-size="11">{_text(t.name, 52)}</text>'
                         f'<rect x="{BAR_LEFT}" y="3" width="{max(x - BAR_LEFT, 2):.1f}" height="10" fill="{color}"/>'
                         f'<text x="{max(x, BAR_LEFT + 2) + 4:.1f}" y="12" font-size="10" fill="#555">{shown}</text>')
    return lines


def _layer_bars(groups: dict[str, list[TensorDiff]], scale: _Scale) -> list[str]:
    lines = []
    for layer, members in groups.items():
        values = np.array([float(t.rel_change or 0.0) for t in members])
        lo, mid, hi = (_bar_x(scale, float(v)) for v in (values.min(), np.median(values), values.max()))
        still = sum(t.trainable and t.status == "unchanged" for t in members)
        color = "#e6194b" if still else "#3b75af"
        lines.append(f'<text x="4" y="12" font-size="11">{_text(layer, 44)} ({len(members)})</text>'
                     f'<rect x="{lo:.1f}" y="3" width="{max(hi - lo, 2):.1f}" height="10" fill="{color}" opacity="0.5"/>'
                     f'<rect x="{mid - 1:.1f}" y="1" width="2" height="14" fill="{color}"/>'
                     f'<text x="{hi + 4:.1f}" y="12" font-size="10" fill="#555">{values.min():.2g}..{values.max():.2g}'
                     f'{f", {still} unchanged" if still else ""}</text>')
    return lines


def other_tensors(tensors: Sequence[TensorDiff]) -> str:
    rows = [f"<tr><td>{_text(t.status)}</td><td>{_text(t.name)}</td><td>{_text(t.shape_a)} {_text(t.dtype_a or '')}</td>"
            f"<td>{_text(t.shape_b)} {_text(t.dtype_b or '')}</td></tr>"
            for t in tensors if t.status in ("added", "removed", "reshaped", "unreadable")]
    if not rows:
        return ""
    return ("<h3>Not compared</h3><table><tr><th>status</th><th>tensor</th><th>A</th><th>B</th></tr>"
            + "".join(rows[:MAX_LISTED]) + "</table>")


def learned_ids(report: DiffReport) -> np.ndarray | None:
    """The ids `diff --tokenizer` looked at (its per-token learning report), when it ran."""
    tokens = getattr(report, "tokens", None)
    if tokens is None:
        return None
    ids = [t.get("id") for t in tokens.to_json().get("tokens", [])]
    return np.array(sorted({i for i in ids if isinstance(i, int) and i >= 0}), np.int64)


def new_row_sections(ca: Checkpoint, cb: Checkpoint, tokenizer: TokenizerInfo | None,
                     looked_at: np.ndarray | None = None) -> list[str]:
    out: list[str] = []
    for v in find_vocab_tensors(cb, map_optimizer(cb)):
        tb, ta = cb.model.get(v.name), ca.model.get(v.name)
        if v.role not in ("embedding", "head") or v.tied_to or tb is None or not readable_rows(tb):
            continue
        if ta is None or not readable_rows(ta) or ta.shape[1] != tb.shape[1]:
            out.append(f'<p class="note">{_text(v.name)}: no table of the same width in A; not compared row by row.</p>')
            continue
        out += row_change_section(v.name, ta, tb, ca, cb, tokenizer, looked_at)
    return out or ['<p class="note">No embedding or head found in B.</p>']


def row_change_section(name: str, ta: TensorInfo, tb: TensorInfo, ca: Checkpoint, cb: Checkpoint,
                       tokenizer: TokenizerInfo | None, looked_at: np.ndarray | None = None) -> list[str]:
    """Every row's relative change, then the new tokens' rows alone (rows past A's: B's row norm over A's median)."""
    rows_a, rows_b = ta.shape[0], tb.shape[0]
    common = min(rows_a, rows_b)
    change = np.full(rows_b, np.nan)
    change[:common] = row_changes(ta, tb, common)
    new, why = new_rows(name, rows_a, rows_b, ca, cb, tokenizer)
    if looked_at is not None and looked_at.size:
        new, why = looked_at[looked_at < rows_b], "the tokens diff --tokenizer looked at"
    codes = np.zeros(rows_b, np.uint8)
    codes[new] = NEW_ROW.code
    codes[common:] = NOT_IN_A.code
    codes[:common][change[:common] == 0] = STILL.code
    if rows_b > rows_a:
        change[common:] = row_norms(tb)[common:] / max(float(np.median(row_norms(ta))), 1e-30)
    regions = [OLD_ROW, NEW_ROW, NOT_IN_A, STILL]
    out = [f"<h3>{_text(name)} ({rows_a:,} rows in A, {rows_b:,} in B)</h3>",
           f"<p class=\"note\">Relative change of each row, ||B_i - A_i|| / ||A_i||, log scale{_bucket_note(rows_b)}"
           + (" (rows past A's row count: ||B_i|| / the median ||A_j||)" if rows_b > rows_a else "") + ".</p>",
           row_chart(change, codes, regions, log=True, label=f"{name} relative change per row"), legend(codes, regions)]
    if not new.size:
        return out + ['<p class="note">No new tokens\' rows known: B has no more rows than A, and neither record nor '
                      "tokenizer names added tokens.</p>"]
    is_new = np.zeros(rows_b, bool)
    is_new[new] = True
    old = change[:common][~is_new[:common]]
    out.append(f'<p class="note">New tokens\' rows ({_text(why)}): {new.size:,}, median {_median(change[new])}; '
               f"the other rows: median {_median(old)}.</p>")
    out.append(row_chart(change[new], codes[new], regions, log=True, label=f"{name} new rows", ids=new))
    return out + [new_rows_table(new, change, codes, token_table(ca, cb, tokenizer, rows_b))]


def _median(values: np.ndarray) -> str:
    finite = values[np.isfinite(values)]
    return f"{float(np.median(finite)):.3g}" if finite.size else "n/a"


def new_rows_table(new: np.ndarray, change: np.ndarray, codes: np.ndarray, table: list[str | None]) -> str:
    rows = ["<table><tr><th>id</th><th>token</th><th>relative change</th></tr>"]
    for i in new[:MAX_LISTED]:
        token = table[i] if i < len(table) else None
        past = " (no row in A: ||B_i|| / median ||A_j||)" if codes[i] == NOT_IN_A.code else ""
        rows.append(f"<tr><td>{i}</td><td><code>{_text(token, 80) if token is not None else ''}</code></td>"
                    f"<td>{change[i]:.3g}{past}</td></tr>")
    more = f"<p class=\"note\">... and {new.size - MAX_LISTED:,} more.</p>" if new.size > MAX_LISTED else ""
    return "".join(rows) + "</table>" + more


def new_rows(name: str, rows_a: int, rows_b: int, ca: Checkpoint, cb: Checkpoint,
             tokenizer: TokenizerInfo | None) -> tuple[np.ndarray, str]:
    """The new tokens' rows of `name` in B, and what says so: rows past A's row count; else a ckptfix record
    (B's, then A's: a repaired A's rows kept by id, or moved by token between its two recorded tokenizers); else
    the tokenizer's ids past its base vocabulary."""
    if rows_b > rows_a:
        return np.arange(rows_a, rows_b), f"rows past A's {rows_a:,}"
    for side, ckpt in (("B", cb), ("A", ca)):
        ids = recorded_new_rows(ckpt, name, rows_b)
        if ids is not None:
            return ids, f"{side}'s ckptfix record"
    if tokenizer is not None and tokenizer.size > tokenizer.base_size:
        return np.arange(tokenizer.base_size, min(tokenizer.size, rows_b)), "the tokenizer's added tokens"
    return np.zeros(0, np.int64), ""


def recorded_new_rows(ckpt: Checkpoint, name: str, rows: int) -> np.ndarray | None:
    record = ckpt.record
    if record is None:
        return None
    changes = record.provenance.get("changes")
    change = next((c for c in changes if isinstance(c, dict) and c.get("tensor") == name), None) \
        if isinstance(changes, list) else None
    if change is None:
        return None
    old, new = change.get("old_rows"), change.get("new")
    if not (isinstance(old, int) and isinstance(new, int) and _count(old) and _count(new)) or not new:
        return None
    if record.provenance.get("rows_moved_by") == "id":
        return np.arange(min(old, rows), min(old + new, rows))
    return _moved_by_token(ckpt, rows)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 1 << 40


def _moved_by_token(ckpt: Checkpoint, rows: int) -> np.ndarray | None:
    """Ids of the recorded new tokenizer whose token the recorded old one lacks (both files as fingerprinted)."""
    record = ckpt.record
    assert record is not None
    new, old = _recorded(record.tokenizer), _recorded(record.from_tokenizer)
    if new is None or old is None:
        return None
    known = old.token_to_id()
    return np.array([i for i, t in enumerate(new.id_to_token()[:rows]) if t is not None and t not in known], np.int64)


def _recorded(ref: Any) -> TokenizerInfo | None:
    from ckptfix.identity import fingerprint
    from ckptfix.tokenizers import load_tokenizer

    if ref is None or not ref.path or ref.fingerprint is None:
        return None
    try:
        info = load_tokenizer(ref.path)
    except CkptfixError:
        return None
    return info if fingerprint(info) == ref.fingerprint else None


def token_table(ca: Checkpoint, cb: Checkpoint, tokenizer: TokenizerInfo | None, rows: int) -> list[str | None]:
    """Token text by id: the tokenizer given, else the one B's (then A's) record or folder says its rows belong to."""
    if tokenizer is not None:
        return tokenizer.id_to_token()
    from ckptfix.identity import known_old_tokenizer

    for ckpt in (cb, ca):
        old, _ = known_old_tokenizer(ckpt, rows)
        if old is not None:
            return old.info.id_to_token()
    return []


# -- writing ------------------------------------------------------------------------------------------------------


def check_target(path: str | os.PathLike, inputs: Sequence[str | os.PathLike], *, force: bool) -> str:
    """Refuse, before any work, a report path that is an input, lies inside one, or exists (without force)."""
    out = os.fspath(path)
    shown = _shown(out)
    for source in [os.fspath(p) for p in inputs]:
        if "://" not in source and (same_file(source, out) or os.path.realpath(source) == os.path.realpath(out)):
            raise RepairError(f"{shown}: is the checkpoint itself; name a new file for the HTML report")
        check_output_path(source, out, force=force)
    if os.path.isdir(out):
        raise RepairError(f"{shown}: is a folder; name a file for the HTML report")
    if os.path.lexists(out) and not force:
        raise RepairError(f"{shown}: already exists; pass force=True to replace it")
    return out


def _shown(path: str) -> str:
    return escape(path)


def write_page(path: str, page: str, *, force: bool) -> None:
    """The page at `path`, whole or not at all: created new (never through a link, never onto an entry that
    appeared meanwhile), or with force the entry replaced atomically (a link replaced, never written through)."""
    data = page.encode("utf-8")
    if force:
        atomic_write(path, data)
    else:
        atomic_new(path, data)


def write_inspect_html(report: Report, path: str | os.PathLike, *, force: bool = False) -> str:
    """Write `inspect_page(report)` to `path` (refused if it exists, unless `force`); the path written."""
    out = check_target(path, [report.ckpt.path], force=force)
    write_page(out, inspect_page(report), force=force)
    return out


def write_diff_html(report: DiffReport, path: str | os.PathLike, *, force: bool = False, trust_pickle: bool = False,
                    tokenizer: str | os.PathLike | None = None,
                    checkpoints: tuple[Checkpoint, Checkpoint] | None = None) -> str:
    """Write `diff_page` to `path` (`tokenizer`: B's, as `diff` took it); the two checkpoints are read again
    (metadata only) unless given."""
    from ckptfix.formats import read_checkpoint
    from ckptfix.tokenizers import load_tokenizer

    out = check_target(path, [report.a.path, report.b.path], force=force)
    ca, cb = checkpoints or (read_checkpoint(report.a.path, trust_pickle=trust_pickle),
                             read_checkpoint(report.b.path, trust_pickle=trust_pickle))
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    write_page(out, diff_page(report, ca, cb, tok), force=force)
    return out
