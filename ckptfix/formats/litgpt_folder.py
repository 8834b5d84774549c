"""litgpt checkpoint folders: `lit_model.pth` (Fabric's `torch.save` of `{"model", "optimizer", "scheduler",
"iter_num", "step_count"}` while training, the bare model state dict when converted) beside
`model_config.yaml`, litgpt's `Config` as `yaml.dump(asdict(config))`.

litgpt rebuilds the model from `model_config.yaml` (`Config.from_file`) before it loads the weights, so its
`padded_vocab_size` (the rows) and `vocab_size` (the tokenizer's; `min(vocab_size, padded_vocab_size)`)
are recorded sizes: read into `extras["model_config.yaml"]` (CKF115 checks them, repair's plan updates
them). Only the top-level `key: integer` lines of those keys are read and rewritten, in place: the rest of
the file (every other key litgpt writes) is copied as it is, so no YAML parser is needed.
"""

from __future__ import annotations

import os
import re

from ckptfix.checkpoint import Checkpoint
from ckptfix.errors import CorruptInput
from ckptfix.formats import torch_file
from ckptfix.untrusted import escape, read_bounded

WEIGHTS, CONFIG = "lit_model.pth", "model_config.yaml"
SIZE_KEYS = ("padded_vocab_size", "vocab_size", "padding_multiple")
_LINE = re.compile(rb"^(padded_vocab_size|vocab_size|padding_multiple):[ \t]*(\S*)[ \t]*$", re.MULTILINE)
MAX_CONFIG_BYTES = 1 << 20  # litgpt's config is about 1.5 KB


def sniff(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, n)) for n in (WEIGHTS, CONFIG))


def read(path: str, *, trust_pickle: bool = False) -> Checkpoint:
    ckpt = torch_file.read(os.path.join(path, WEIGHTS), trust_pickle=trust_pickle)
    ckpt.path, ckpt.format = path, "litgpt"
    ckpt.files.setdefault("model", os.path.join(path, WEIGHTS))
    ckpt.extras[CONFIG] = config_sizes(os.path.join(path, CONFIG))
    return ckpt


def config_sizes(file: str) -> dict[str, int]:
    """The vocab sizes `model_config.yaml` records (a null `padded_vocab_size` is left out: litgpt computes it)."""
    sizes: dict[str, int] = {}
    for key, value in _lines(file, read_bounded(file, MAX_CONFIG_BYTES)):
        if value.isdigit():
            sizes[key] = int(value)
        elif value not in ("null", "~", ""):
            raise CorruptInput(f"{escape(file)}: {key} is {value[:40]!r}, not an integer")
    return sizes


def _lines(file: str, data: bytes) -> list[tuple[str, str]]:
    found = [(m.group(1).decode(), m.group(2).decode("utf-8", "replace")) for m in _LINE.finditer(data)]
    keys = [k for k, _ in found]
    if len(set(keys)) != len(keys):
        raise CorruptInput(f"{escape(file)}: a vocab size key appears twice at the top level")
    return found


def rewrite_config(src: str, dst: str, changes: dict[str, int]) -> None:
    """`src` with the given top-level sizes replaced, every other byte as it was."""
    data = read_bounded(src, MAX_CONFIG_BYTES)
    _lines(src, data)  # refuses a repeated key

    def put(m: re.Match) -> bytes:
        key = m.group(1).decode()
        return m.group(0) if key not in changes else f"{key}: {changes[key]}".encode()

    from ckptfix.io import write_new

    write_new(dst, _LINE.sub(put, data), replace=True)  # in ckptfix's own temporary folder
