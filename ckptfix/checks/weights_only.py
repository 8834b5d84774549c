"""What `torch.load(weights_only=True)` (torch's default since 2.6) refuses, and what ckptfix can convert."""

from __future__ import annotations

from collections.abc import Iterator

from ckptfix.checks.codes import Context, Finding, check, finding

MAX_LISTED = 6  # objects named in one finding message; the JSON report lists them all


def _uses(ctx: Context) -> list:
    import dataclasses

    from ckptfix.formats.data_globals import raw_uses, uses

    cached = getattr(ctx, "_weights_only_uses", None)  # three checks read the same walk
    if cached is None:
        cached = list(raw_uses(ctx.ckpt))
        for name, tree in ctx.ckpt.pickles.items():  # a folder's other pickles: optimizer.pt, a .bin shard
            cached += [dataclasses.replace(u, path=f"{name}:{u.path}") for u in uses(tree)]
        object.__setattr__(ctx, "_weights_only_uses", cached)
    return cached


def convert_command(path: str) -> str:
    import os

    root, ext = os.path.splitext(path.rstrip("/"))
    if ext == ".tar":  # timm's last.pth.tar
        root, inner = os.path.splitext(root)
        ext = inner + ext
    return f"ckptfix convert {path} -o {root}.weights_only{ext or '.pth'}"


@check("CKF704", "warning", "torch.load(weights_only=True) refuses this file",
       "The pickle constructs objects of classes outside torch's weights-only allowlist (argparse.Namespace, "
       "numpy scalars, pathlib paths, omegaconf configs...). ckptfix read them without running anything; "
       "`ckptfix convert` writes a copy that loads with weights_only=True. An add_safe_globals line is printed only "
       "when every class is on ckptfix's data list.")
def weights_only_refuses(ctx: Context) -> Iterator[Finding]:
    refusing = [u for u in _uses(ctx) if u.torch_refuses]
    names = sorted({g for u in refusing for g in u.torch_refuses})
    # globals no object in the tree shows (a tensor subclass given to `_rebuild_from_type_v2`), and opcodes
    others = [r for r in ctx.ckpt.weights_only_refusals if r.removeprefix("global ") not in names]
    opcodes = [r for r in others if not r.startswith("global ")]  # opcodes, a legacy untyped storage
    names += [r.removeprefix("global ") for r in others if r.startswith("global ")]
    if not names and not opcodes:
        return
    listed = "; ".join(f"{u.path} ({u.cls}{_fields(u.fields)})" for u in refusing[:MAX_LISTED])
    more = f"; and {len(refusing) - MAX_LISTED} more" if len(refusing) > MAX_LISTED else ""
    code = [c for u in refusing for c in u.runs_code]
    yield finding("CKF704", f"torch.load(weights_only=True) refuses this file because of: "
                  f"{', '.join(names + opcodes)}" + (f"; at {listed}{more}" if listed else ""),
                  pytorch=_what_torch_does(refusing, names, code) if names else _OTHER_PROTOCOL,
                  fix=_weights_only_fix(ctx.ckpt.path, refusing, names, code, opcodes))


_OTHER_PROTOCOL = ("torch.load() raises 'Weights only load failed ... Unsupported operand' (its unpickler reads the "
                   "opcodes of torch.save's pickle protocol 2 only; or its legacy reader fails on this content); "
                   "ckptfix read the file without importing or calling anything.")


def _what_torch_does(refusing: list, names: list[str], code: list[str]) -> str:
    from ckptfix.formats.data_globals import safe_to_allowlist

    head = ("torch.load() raises 'Weights only load failed ... Unsupported global'. weights_only=False "
            "(or TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1) would run the pickle; ckptfix read it without importing or "
            "calling anything")
    if code:
        return f"{head}. It is not data: loading it would call {', '.join(code[:3])}."
    unknown = [n for n in names if not safe_to_allowlist(n)]
    if not unknown:
        return f"{head}: these objects are data."
    return (f"{head}. The pickle only constructs objects of {', '.join(unknown)} (no call of the file's choosing), "
            "but loading them runs those classes' own __new__/__setstate__, which ckptfix does not import to check.")


def _weights_only_fix(path: str, refusing: list, names: list[str], code: list[str], opcodes: list[str]) -> str:
    from ckptfix.formats.data_globals import add_safe_globals_line, safe_to_allowlist

    if code:
        return ("Do not load this file (with weights_only=False or with any allowlist): it runs code when loaded. "
                "Re-create the checkpoint from a source you trust.")
    steps = []
    if all(u.convertible for u in refusing):
        steps.append(f"{convert_command(path)} (plain values, listed in the output's record)")
    unknown = [n for n in names if not safe_to_allowlist(n)]
    if not unknown:
        if names:
            steps.append(f"if you trust the file: {add_safe_globals_line(names)}")
    elif not steps:
        steps.append(f"re-save these values as plain data (dict, list, numbers, tensors) in the training script; "
                     f"allowlist {', '.join(unknown)} with torch.serialization.add_safe_globals only if you wrote "
                     "those classes (ckptfix names no class it cannot check)")
    if opcodes and not names:  # another pickle protocol: torch.save's default (2) is what its loader reads
        steps.append("re-save it with torch.save's default pickle_protocol=2")
    return "; or, ".join(steps)


@check("CKF705", "warning", "an object ckptfix cannot convert to weights-only data",
       "A pickled object whose state only its class can interpret (a custom __setstate__ state, constructor "
       "arguments, an object array): `ckptfix convert` refuses the file rather than guess.")
def not_convertible(ctx: Context) -> Iterator[Finding]:
    for u in _uses(ctx):
        if not u.convertible and not u.runs_code:
            yield finding("CKF705", u.why_not,
                          pytorch="torch.load(weights_only=True) refuses it; nothing in it was run by ckptfix.",
                          fix="Re-save this value as plain data (dict, list, numbers, tensors) in the training "
                          "script, or allowlist its class with torch.serialization.add_safe_globals if you trust it.")


def _fields(fields: object) -> str:
    text = repr(fields) if fields is not None else ""
    return f": {text[:80]}{'...' if len(text) > 80 else ''}" if text else ""


@check("CKF706", "error", "the pickle runs code when loaded",
       "A call in the pickle is not data: `copyreg._reconstructor` with a base other than `object` (it runs "
       "`base.__init__`), or a function outside ckptfix's data list. Seen only where ckptfix reads a pickle as "
       "inert records (--trust-pickle, an HF folder's training_args.bin); the default read refuses the file.")
def runs_code(ctx: Context) -> Iterator[Finding]:
    for u in _uses(ctx):
        if u.runs_code:
            yield finding("CKF706", f"{u.path}: loading it would call {', '.join(u.runs_code[:3])}",
                          pytorch="torch.load(weights_only=False) and pickle.load run these calls; "
                          "weights_only=True refuses them. ckptfix ran nothing.",
                          fix="Do not load this file. Re-create the checkpoint from a source you trust.")
