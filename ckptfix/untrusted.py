"""The input boundary: every byte and value ckptfix takes from a checkpoint, tokenizer or config passes here.

Three things live here, each used by every reader so there is one answer to each question:

* files: an input path must be a regular file or a folder (a FIFO, device or socket is refused at once,
  from `stat`, and any open is non-blocking with the check made on the opened descriptor), and a read
  is bounded: `read_bounded` refuses a file larger than its cap before reading it;
* values: `want_*` check a value read from a structure (a pickle tree, DCP `.metadata`, a JSON
  config) into the type the code past the boundary expects, raising `CorruptInput` naming the file,
  the field and what was expected (the CLI prints it as one line, exit 2);
* text: `escape` makes any string that came from an input safe for a terminal line.

The limits (documented in SECURITY.md) are far above every real file and far below what would hurt.
"""

from __future__ import annotations

import json
import math
import os
import stat
import sys
from typing import Any, BinaryIO

from ckptfix.errors import CorruptInput, UnreadableCheckpoint

# Bounds on files read whole. The largest real tokenizer file we know is Mistral's tekken.json (19 MB);
# HF index files for 1T-parameter models are a few MB; configs are KB.
MAX_TOKENIZER_BYTES = 256 << 20
MAX_JSON_BYTES = 256 << 20
MAX_JSON_DIGITS = 400  # an integer literal in JSON; int64 needs 19 digits
MAX_JSON_DEPTH = 200  # nesting of JSON arrays/objects; real configs stay under 10
MAX_TEXT = 200  # characters of an input string shown in one message


def escape(text: Any, limit: int | None = None) -> str:
    """`text` for a terminal: control characters (escape sequences, newlines that would forge report
    lines, bidi overrides) shown as `\\xNN`/`\\uNNNN`; cut to `limit` characters when given."""
    text = text if isinstance(text, str) else str(text)
    cut = limit is not None and len(text) > limit
    if cut:
        text = text[:limit]
    if text.isprintable():
        return text + ("..." if cut else "")
    out = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    return out + ("..." if cut else "")


def escape_lines(text: str) -> str:
    """A multi-line report: each line escaped, the line breaks kept."""
    return "\n".join(escape(line) for line in text.split("\n"))


# --- files ------------------------------------------------------------------------------------------

def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "special file"


def check_input(path: str | os.PathLike, *, error: type[Exception] = UnreadableCheckpoint) -> os.stat_result:
    """`path` must exist and be a regular file or a folder (following a symlink to it). Nothing is opened."""
    shown = escape(os.fspath(path))
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{shown}: no such file or folder") from None
    except OSError as exc:
        raise error(f"{shown}: cannot read ({exc.strerror or exc})") from None
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise error(f"{shown}: not a regular file or folder (a {_kind(st.st_mode)})")
    return st


# --- folders: what lives in them ---------------------------------------------------------------------
# Every folder a user names as input (a checkpoint folder, a tokenizer folder) is registered here; a file read
# below one must resolve inside it. A link out of the folder is refused where the file is opened (one place:
# `open_regular`, which every reader uses), so its target's bytes are never read, reported or copied into OUT.
_INPUT_ROOTS: dict[str, str] = {}  # the folder as named (absolute) -> the real folder its files must live in


def input_root(path: str | os.PathLike) -> None:
    """Register `path` (when a folder) as an input folder: files read below it must resolve inside it."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path) and path not in _INPUT_ROOTS:
        _INPUT_ROOTS[path] = _anchor(os.path.realpath(path))


def _anchor(real: str) -> str:
    """The folder an input folder's files may live in: itself, or for a Hugging Face hub cache snapshot
    (`models--ORG--NAME/snapshots/REV/`, whose files are links to `../../blobs/`) its repository folder."""
    snapshots = os.path.dirname(real)
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) == "snapshots" and os.path.basename(repo).startswith(("models--", "datasets--")):
        return repo
    return real


def check_inside(path: str | os.PathLike, *, error: type[Exception] = UnreadableCheckpoint) -> None:
    """Refuse a file below a registered input folder that resolves outside it (through a link in its name or
    in a folder on the way, or `..`)."""
    if not _INPUT_ROOTS:
        return
    named = os.fspath(path)
    absolute = os.path.abspath(named)  # `..` collapsed
    parts = os.path.join(os.getcwd(), named).split(os.sep)
    spelled = os.sep + os.sep.join(p for p in parts if p not in ("", "."))  # `..` kept: a name climbing out
    for root, anchor in _INPUT_ROOTS.items():  # below it as resolved, or as spelled
        if not (absolute.startswith(root + os.sep) or spelled.startswith(root + os.sep)):
            continue
        real = os.path.realpath(named)
        if not real.startswith(anchor + os.sep):
            raise error(f"{escape(named)}: leads out of the input folder {escape(root)} (to {escape(real)}); "
                        "ckptfix reads only what lives in the folder: copy the file in, or name its folder "
                        "itself")


def open_regular(path: str | os.PathLike, *, error: type[Exception] = UnreadableCheckpoint) -> BinaryIO:
    """Open a regular file for reading. A FIFO or device would block or never end: refused from `stat`
    first (a FIFO is never opened), then the open is non-blocking and the check repeated on the opened
    file, so nothing can be swapped in between. Below an input folder, only a file that lives in it."""
    shown = escape(os.fspath(path))
    check_inside(path, error=error)
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{shown}: not a regular file (a {_kind(st.st_mode)})")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise error(f"{shown}: cannot open ({exc.strerror or exc})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(f"{shown}: not a regular file (a {_kind(mode)})")
    remote = sys.modules.get("ckptfix.remote")  # imported only once a URL was named: else no mirror exists
    return remote.wrap(os.fdopen(fd, "rb"), path) if remote is not None else os.fdopen(fd, "rb")


def read_bounded(path: str | os.PathLike, limit: int, *, what: str = "file",
                 error: type[Exception] = UnreadableCheckpoint) -> bytes:
    """The whole of a regular file of at most `limit` bytes (checked before reading: a sparse 6 GB
    file is refused without allocating anything)."""
    with open_regular(path, error=error) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise error(f"{escape(os.fspath(path))}: {what} of {size:,} bytes is larger than ckptfix reads "
                        f"({limit >> 20} MiB); not a real {what}?")
        try:  # read(n) allocates n bytes up front: ask for what the file holds, not the cap
            data = f.read(size + 1)
            while len(data) <= limit and (more := f.read(1 << 20)):
                data += more
        except OSError as exc:
            raise error(f"{escape(os.fspath(path))}: cannot read ({exc.strerror or exc})") from None
    if len(data) > limit:  # grew while we read
        raise error(f"{escape(os.fspath(path))}: {what} larger than {limit >> 20} MiB")
    return data


# --- JSON -------------------------------------------------------------------------------------------

def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_JSON_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def parse_json(data: bytes, origin: str, *, error: type[Exception] = UnreadableCheckpoint,
               bad: str = "not valid JSON") -> Any:
    """JSON from an input: UTF-8 (a BOM allowed), integers of at most MAX_JSON_DIGITS digits, nesting
    at most MAX_JSON_DEPTH deep. `NaN`/`Infinity` (Python's json writes them) are kept. Errors read
    "<origin>: <bad> (<why>)"."""
    shown = escape(origin)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise error(f"{shown}: {bad} (not UTF-8 text, byte {exc.start})") from None
    depth = _json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise error(f"{shown}: {bad} (nested {depth} deep; at most {MAX_JSON_DEPTH})")
    try:
        return json.loads(text, parse_int=_bounded_int)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError; so is a too-long number
        raise error(f"{shown}: {bad} ({escape(exc, MAX_TEXT)})") from None


def _json_depth(text: str) -> int:
    """An upper bound of the nesting depth (brackets inside strings count too: never an under-estimate)."""
    if len(text) < 2 * MAX_JSON_DEPTH:
        return 0
    depth = best = 0
    # Fast path: only texts with many brackets can nest deeply.
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return 0
    for c in text:
        if c in "[{":
            depth += 1
            if depth > best:
                best = depth
                if best > MAX_JSON_DEPTH:
                    return best
        elif c in "]}":
            depth -= 1
    return best


def load_json_file(path: str | os.PathLike, *, limit: int = MAX_JSON_BYTES, what: str = "JSON file",
                   error: type[Exception] = UnreadableCheckpoint, bad: str = "not valid JSON") -> Any:
    """A JSON file from an input folder: regular, bounded, parsed with `parse_json`'s limits."""
    return parse_json(read_bounded(path, limit, what=what, error=error), os.fspath(path), error=error, bad=bad)


# --- values -----------------------------------------------------------------------------------------

def _got(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, (int, float)):
        text = repr(value) if not isinstance(value, int) or value.bit_length() < 64 else f"a {value.bit_length()}-bit int"
        return text
    if isinstance(value, str):
        return f"the string {escape(repr(value), 40)}"
    return f"a {escape(type(value).__name__, 40)}"


def fail(origin: str, field: str, expected: str, value: Any) -> CorruptInput:
    """The one error for a value of the wrong type, sign, range or size."""
    return CorruptInput(f"{escape(origin)}: {escape(field, MAX_TEXT)}: expected {expected}, got {_got(value)}")


def want_int(value: Any, origin: str, field: str, *, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    """An integer (not a bool) in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise fail(origin, field, f"an integer in [{lo}, {hi}]", value)
    return int(value)


def want_number(value: Any, origin: str, field: str, *, finite: bool = False) -> float:
    """An int or float (not a bool) that converts to a float; finite when asked."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(origin, field, "a number", value)
    try:
        out = float(value)
    except OverflowError:
        raise fail(origin, field, "a number within float range", value) from None
    if finite and not math.isfinite(out):
        raise fail(origin, field, "a finite number", value)
    return out


def want_str(value: Any, origin: str, field: str, *, max_len: int = 1 << 16) -> str:
    if not isinstance(value, str) or len(value) > max_len:
        raise fail(origin, field, f"a string of at most {max_len} characters", value)
    return value


def want_dict(value: Any, origin: str, field: str) -> dict:
    if not isinstance(value, dict):
        raise fail(origin, field, "a dict", value)
    return value


def want_list(value: Any, origin: str, field: str, *, max_len: int = 1 << 24) -> list | tuple:
    if not isinstance(value, (list, tuple)) or len(value) > max_len:
        raise fail(origin, field, f"a list of at most {max_len:,} items", value)
    return value


def check_plain_tree(value: Any, origin: str, field: str, *, max_nodes: int = 1 << 20) -> Any:
    """A JSON-like record (dicts with str keys, lists, str/int/float/bool/None) that is a tree: no
    container shared or nested in itself (a memo-shared DAG would expand exponentially when written
    as JSON), at most `max_nodes` nodes, nested at most MAX_JSON_DEPTH deep (json.dumps and the renderers
    recurse). Walked with an explicit stack."""
    seen: set[int] = set()
    stack, nodes = [(value, 0)], 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            raise fail(origin, field, f"a record of at most {max_nodes:,} values", value)
        if depth > MAX_JSON_DEPTH:
            raise CorruptInput(f"{escape(origin)}: {escape(field, MAX_TEXT)}: expected a record nested at most "
                               f"{MAX_JSON_DEPTH} deep, got one nested deeper")
        if node is None or isinstance(node, (bool, str, float)):
            continue
        if isinstance(node, int):
            if node.bit_length() > 64:
                raise fail(origin, field, "integers of at most 64 bits", node)
            continue
        if not isinstance(node, (dict, list, tuple)):
            raise fail(origin, field, "a JSON-like record", node)
        if id(node) in seen:
            raise fail(origin, field, "a tree (no shared or cyclic sub-objects)", node)
        seen.add(id(node))
        if isinstance(node, dict):
            if not all(isinstance(k, str) for k in node):
                raise fail(origin, field, "string keys", next(k for k in node if not isinstance(k, str)))
            stack.extend((v, depth + 1) for v in node.values())
        else:
            stack.extend((v, depth + 1) for v in node)
    return value


MAX_DIMS = 64  # numpy's limit; real tensors have a handful
INT64_MAX = (1 << 63) - 1
MAX_DIM = 1 << 48  # one dimension's size: 256 TiB of bytes; (0, 2**62) is empty but plans index its rows


def want_shape(value: Any, origin: str, field: str) -> tuple[int, ...]:
    """A tensor shape: at most MAX_DIMS non-negative int64 sizes whose product is an int64 too."""
    if isinstance(value, (list, tuple)) and len(value) > MAX_DIMS:
        raise CorruptInput(f"{escape(origin)}: {escape(field, MAX_TEXT)}: expected a shape of at most {MAX_DIMS} "
                           f"dimensions, got {len(value):,}")
    dims = tuple(want_int(d, origin, f"{field}[{i}]") for i, d in enumerate(want_list(value, origin, field)))
    if math.prod(dims) > INT64_MAX:
        raise fail(origin, field, "at most 2**63 elements", list(dims))
    if any(d > MAX_DIM for d in dims):
        raise fail(origin, field, "dimensions of at most 2**48", list(dims))
    return dims
