"""Exceptions ckptfix raises for bad input; the CLI turns each into one line and exit code 2."""

from __future__ import annotations


class CkptfixError(Exception):
    """Base class: a problem with the user's input or request, reported without a traceback."""


class UnreadableCheckpoint(CkptfixError):
    """The file or folder is not a checkpoint ckptfix can read (corrupt, truncated, wrong format)."""


class UnrecognisedFolder(UnreadableCheckpoint):
    """A folder no reader takes for a checkpoint (inspect and the guard then look for a run's checkpoints in it)."""


class UnsafePickle(CkptfixError):
    """A pickle needs globals outside the allowlist; loading it could execute code."""

    def __init__(self, path: str, globals_needed: list[str], calls: list[str] | None = None, *, hint: bool = True):
        self.path = path
        self.globals_needed = sorted(set(globals_needed))
        self.calls = list(calls or [])
        names = ", ".join(self.globals_needed) or "unknown"
        would = f"; loading it would call {', '.join(self.calls)}" if self.calls else ""
        super().__init__(
            f"{path}: refusing to unpickle: it needs globals outside the safe allowlist ({names}){would}; "
            "loading it could execute code. " + ("Pass trust_pickle=True only if you trust its author." if hint else
                                                 "--trust-pickle does not apply: this file is only ever read as data.")
        )


# Library errors name an option as the keyword argument a Python caller passes (`force=True`); the CLI
# prints the same message with its flag (`--force`). One table, so the two spellings cannot drift.
KEYWORD_FLAGS = {
    "force=True": "--force",
    "trust_pickle=True": "--trust-pickle",
    "from_tokenizer=OLD": "--from-tokenizer OLD",
    "keep_ids=True": "--keep-ids",
}


def for_cli(message: str) -> str:
    """`message` as the command line says it: each keyword argument replaced by its flag where the message
    tells what to pass ("pass force=True", "or keep_ids=True", "(force=True does not ..."), not inside a
    value quoted from the input."""
    import re

    for keyword, flag in KEYWORD_FLAGS.items():
        message = re.sub(r"(?:(?<=[Pp]ass )|(?<=or )|(?<=\())" + re.escape(keyword) + r"(?= )", flag, message)
    return message


def for_api(message: str) -> str:
    """`message` (a repair plan's note, written for the command line) as a Python caller passes it: each flag of
    `KEYWORD_FLAGS` replaced by its keyword argument where the note tells what to pass ("pass --from-tokenizer OLD")."""
    import re

    for keyword, flag in KEYWORD_FLAGS.items():
        message = re.sub(r"(?:(?<=[Pp]ass )|(?<=or )|(?<=\())" + re.escape(flag) + r"(?![\w-])", keyword, message)
    return message


class TokenizerError(CkptfixError):
    """The tokenizer path is not a tokenizer ckptfix can read."""


class RepairError(CkptfixError):
    """A repair cannot be carried out as requested."""


class CorruptInput(UnreadableCheckpoint):
    """A value read from an input has the wrong type, sign, range or size (message: path, field, expected)."""
