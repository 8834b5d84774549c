"""Human-readable rendering of reports: compact sections, then findings."""

from __future__ import annotations

from typing import Any

from ckptfix.inspect import Report
from ckptfix.untrusted import escape

_WIDTH = 11


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def _join(lines: list[str]) -> str:
    # Names come from the checkpoint: control characters (terminal escape sequences, newlines that
    # would forge report lines) are shown escaped, never sent to the terminal.
    return "\n".join(escape(line) for line in lines)


def _line(label: str, text: str) -> str:
    return f"{label:<{_WIDTH}}{text}"


def render_report(report: Report) -> str:
    data = report.to_json()
    lines = [f"{data['path']}  ({data['format']})"]
    m = data["model"]
    dtypes = ", ".join(f"{k} x{v}" for k, v in m["dtypes"].items())
    tied = "; tied: " + ", ".join(f"{a} -> {b}" for a, b in m["tied"].items()) if m["tied"] else ""
    lines.append(_line("model", f"{m['tensors']} tensors, {_count(m['parameters'])} values, "
                                f"{_size(m['bytes'])} ({dtypes}){tied}"))
    lines.append(_line("optimizer", _optimizer(data["optimizer"])))
    lines.append(_line("scheduler", _scheduler(data["scheduler"])))
    lines.append(_line("scaler", _scaler(data["scaler"])))
    lines.extend(_vocab(data["vocab"]))
    for note in data["notes"]:
        lines.append(_line("note", note))
    lines.append("")
    s = data["summary"]
    lines.append(f"findings: {s['error']} error(s), {s['warning']} warning(s), {s['info']} info")
    for f in report.findings:
        lines.extend(render_finding(f.to_json()))
    return _join(lines)


def render_finding(f: dict[str, Any]) -> list[str]:
    pad = " " * 15
    out = [f"  {f['severity']:<7} {f['code']}  {f['title']}", f"{pad}{f['message']}"]
    if f["tensors"]:
        shown = ", ".join(f["tensors"][:6]) + (f" (+{len(f['tensors']) - 6} more)" if len(f["tensors"]) > 6 else "")
        out.append(f"{pad}tensors: {shown}")
    if f["pytorch"]:
        out.append(f"{pad}pytorch: {f['pytorch']}")
    if f["fix"]:
        out.append(f"{pad}fix:     {f['fix']}")
    return out


_MAPPING = {"torch": "torch's param_names", "recorded": "recorded names", "fqn": "parameter names", "position": "position and shape",
            "hf-groups": "two decay groups in model order", "aligned": "order and shape", "shape": "unique shapes (weak)",
            "none": "nothing"}


def _optimizer(o: dict | None) -> str:
    if o is None:
        return "none saved"
    groups = "; ".join(_group(g) for g in o["param_groups"][:4])
    steps = o["step"] if isinstance(o["step"], list) else [o["step"]]
    step = ", ".join(f"{x:g}" if isinstance(x, float) else str(x) for x in steps) or "none"
    return (f"{o['type']}, {len(o['param_groups'])} group(s) [{groups}], {o['params']} params "
            f"({o['params_with_state']} with state: {', '.join(o['state_keys']) or 'none'}), step {step}, "
            f"mapped by {_MAPPING.get(o['mapping'], o['mapping'])}, {_size(o['state_bytes'])}")


def _group(g: dict) -> str:
    parts = [f"{g['params']} params", f"lr {g['lr']:.3g}" if isinstance(g.get("lr"), float) else f"lr {g.get('lr')}"]
    if "betas" in g:
        parts.append(f"betas {tuple(g['betas'])}")
    wd = g.get("weight_decay")
    if wd:  # a float, or its text where it is not finite ("nan", "inf": what `plain` makes of them)
        parts.append(f"wd {wd:g}" if isinstance(wd, float) else f"wd {wd}")
    return " ".join(parts)


def _scheduler(s: dict | None) -> str:
    if s is None:
        return "none saved"
    lr = s.get("last_lr")
    lrs = ", ".join(f"{x:.3g}" for x in lr) if isinstance(lr, list) and all(isinstance(x, float) for x in lr) else lr
    return f"{s['type']}, last_epoch {s.get('last_epoch')}, last lr [{lrs}]"


def _scaler(s: dict | None) -> str:
    if s is None:
        return "none saved"
    if not s.get("enabled"):
        return "saved, disabled (empty state)"
    return f"scale {s.get('scale')}, growth tracker {s.get('growth_tracker')}, interval {s.get('growth_interval')}"


def _vocab(v: dict) -> list[str]:
    tok = v["tokenizer"]
    lines = []
    if tok is None:
        lines.append(_line("vocab", "no tokenizer given (--tokenizer PATH compares rows with it)"))
    else:
        # added_tokens may include tokens inside the base vocabulary ([UNK], [PAD]): count those past it.
        beyond = tok["size"] - tok["base_size"]
        entries = f"; {tok['added']} added-token entries" if tok["added"] != beyond else ""
        lines.append(_line("vocab", f"tokenizer {tok['source']} ({tok['kind']}): {tok['size']} tokens "
                                    f"({tok['base_size']} base + {beyond} added{entries})"))
    for t in v["tensors"]:
        moments = ", ".join(f"{k} {s[0]} rows" for k, s in t["moments"].items())
        tied = f", tied to {t['tied_to']}" if t["tied_to"] else ""
        own = f" ({t['rows'] - t['offset']} token rows + {t['offset']} of the model's own)" if t["offset"] else ""
        lines.append(_line("", f"{t['name']}  {t['role']}  {t['rows']} rows{own}{tied}"
                               + (f"; moments: {moments}" if moments else "")))
    if v["tied_head_not_stored"]:
        lines.append(_line("", "lm_head tied to the input embedding (not stored; config.json tie_word_embeddings "
                               "or safetensors alias metadata)"))
    return lines


def render_repair(result) -> str:
    data = result.to_json()
    verb = "would write" if data["dry_run"] else ("wrote" if data["output"] else "wrote nothing")
    tok = data["tokenizer"]
    lines = [f"{data['source']}  ({data['format']})  ->  {data['output'] or '-'}",
             _line("tokenizer", f"{tok['source']}: {tok['size']} tokens; target rows {data['target_rows']}"),
             _line("policy", f"{data['policy']}; optimizer state {data['optimizer_state']}, "
                             f"scheduler {data['scheduler_state']}, new rows init {data['init']}"
                             + ("; the loop must re-warm the LR" if data["rewarm"] else ""))]
    for c in data["changes"]:
        lines.append(_line("", f"{c['tensor']}  {c['old_shape']} -> {c['new_shape']}  kept {c['kept']}, "
                               f"moved {c['moved']}, new {c['new']}, dropped {c['dropped']}"))
    if not data["changes"]:
        lines.append(_line("", "no tensor changes"))
    if data["scaler_reset"]:
        lines.append(_line("scaler", "collapsed/non-finite scale reset to 65536"))
    for value in (data.get("audit") or {}).get("values", []):  # checked, and left as it is on purpose
        if value["status"] == "kept":
            lines.append(_line("kept", f"{value['path']} ({value['value']}): {value['reason']}"))
    for note in data["notes"]:
        lines.append(_line("note", note))
    if data["backup"]:
        lines.append(_line("backup", data["backup"]))
    lines.append(f"{verb} {data['output']}" if data["output"] else verb)
    if data["output"] and not data["dry_run"]:
        from ckptfix.resume_hints import resume_lines

        for line in resume_lines(data["format"], data["output"], data["target_rows"], tok["size"], data["rewarm"]):
            lines.append(_line("resume", line))
    return _join(lines)


def render_convert(result: Any) -> str:
    """A `ckptfix convert` result: each object torch refuses, what it became, where it went."""
    data = result.to_json()
    verb = "would write" if data["dry_run"] else ("wrote" if data["output"] else "wrote nothing")
    lines = [f"{data['source']}  ->  {data['output'] or '-'}"]
    if data["refused_by_torch"]:
        lines.append(_line("refused", "torch.load(weights_only=True) refuses: " + ", ".join(data["refused_by_torch"])))
    for c in data["conversions"]:
        lines.append(_line("converted", f"{c['path']}  {c['class']} -> {c['to']}"
                                        + (f"  ({c['detail']})" if c.get("detail") else "")))
    for note in data["notes"]:
        lines.append(_line("note", note))
    if data["backup"]:
        lines.append(_line("backup", data["backup"]))
    if data["output"]:
        lines.append(f"{verb} {data['output']}" + ("" if data["dry_run"] else
                                                   ": it loads with torch.load(weights_only=True)"))
    else:
        lines.append("dry run: nothing written" if data["dry_run"] else verb)
    return _join(lines)


def render_diff(report: Any) -> str:
    """A `ckptfix diff` report (ckptfix.compare.DiffReport): sides, counts, verdict, then the tensors."""
    data = report.to_json()
    lines = [_line(k.upper(), f"{data[k]['path']}  ({data[k]['format']}, {_side_step(data[k])})") for k in "ab"]
    s = data["summary"]
    lines.append(_line("tensors", f"{s['changed']} changed, {s['unchanged']} unchanged, {s['added']} added, "
                                  f"{s['removed']} removed, {s['reshaped']} reshaped"
                                  + (f", {s['unreadable']} unreadable" if s["unreadable"] else "")))
    source = "" if s["trainable_from"] == "not known" else f" (from {s['trainable_from']})"
    lines.append(_line("trainable", data["summary_line"] + source))
    lines.append(_line("verdict", data["verdict"]))
    trainable = [t for t in data["tensors"] if t["trainable"]]
    moved = sorted((t for t in trainable if t["status"] == "changed"),
                   key=lambda t: t["rel_change"] if isinstance(t["rel_change"], float) else float("inf"), reverse=True)
    for t in moved[:10]:
        lines.append(_line("changed", f"{t['name']}  max|d| {_g(t['max_abs'])}  rel {_g(t['rel_change'])}"))
    still = [t["name"] for t in trainable if t["status"] == "unchanged"]
    if still and moved:  # when nothing moved the verdict says it; list the odd ones out only
        lines.append(_line("unchanged", ", ".join(still[:8]) + (f" (+{len(still) - 8} more)" if len(still) > 8 else "")))
    for t in data["tensors"]:
        if t["status"] == "added":
            lines.append(_line("added", f"{t['name']} {t['shape_b']} {t['dtype_b']}"))
        elif t["status"] == "removed":
            lines.append(_line("removed", f"{t['name']} {t['shape_a']} {t['dtype_a']}"))
        elif t["status"] == "reshaped":
            lines.append(_line("reshaped", f"{t['name']} {t['shape_a']} {t['dtype_a']} -> {t['shape_b']} {t['dtype_b']}"))
    lines.extend(_tokens(data["tokens"]))
    for note in data["notes"]:
        lines.append(_line("note", note))
    return _join(lines)


def _tokens(tokens: dict | None) -> list[str]:
    """diff's per-token section: one line per new token (its embedding row, its head row), then causes and fixes."""
    if tokens is None:
        return []
    lines = [_line("tokens", tokens["summary"])]
    for t in tokens["tokens"]:
        name = f"{t['token']!r} ({t['id']})" if t["token"] is not None else f"id {t['id']}"
        verdict = {True: "learned", False: "NOT learned", None: "not known"}[t["learned"]]
        head = _row(t["head"]) + (" (the softmax alone: never a target)" if t["cause"] == "never-in-data"
                                  and t["head"]["status"] == "learned" else "")
        lines.append(_line("", f"{name}  {verdict}: embedding {_row(t['embedding'])}; head {head}"))
    for cause in tokens["causes"]:
        lines.append(_line("cause", cause))
    for fix in tokens["fixes"]:
        lines.append(_line("fix", fix))
    for note in tokens["notes"]:
        lines.append(_line("note", note))
    return lines


def _row(r: dict) -> str:
    status = r["status"]
    if status in ("tied", "frozen"):  # the cause line says why, once
        return status
    if status == "unknown":
        return f"not known ({r['detail']})" if r["detail"] else "not known"
    parts = [{"decay-only": "weight decay only", "no-row-in-A": "new since A"}.get(status, status)]
    if isinstance(r["rel_change"], float) or r["rel_change"] == "inf":
        parts.append(f"rel {_g(r['rel_change'])}")
    if r["decay_factor"] is not None:
        parts.append(f"B = A x {r['decay_factor']:.5f}")
    if r["exp_avg_sq_row_zero"] is not None:
        parts.append("exp_avg_sq row 0" if r["exp_avg_sq_row_zero"] else "exp_avg_sq > 0")
    return parts[0] + (f" ({', '.join(parts[1:])})" if len(parts) > 1 else "")


def _side_step(side: dict) -> str:
    return "unknown step" if side["step"] is None else f"step {side['step']:g}"


def _g(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
