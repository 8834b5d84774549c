"""What `torch.load(weights_only=True)` (torch's default since 2.6) refuses, and what ckptfix can convert."""

from __future__ import annotations

from collections.abc import Iterator

from ckptfix.checks import Context, Finding, check, finding

MAX_LISTED = 6  # objects named in one finding message; the JSON report lists them all


def _uses(ctx: Context) -> list:
    from ckptfix.formats.data_globals import uses

    cached = getattr(ctx, "_weights_only_uses", None)  # two checks read the same walk
    if cached is None:
        cached = uses(ctx.ckpt.raw) if ctx.ckpt.raw is not None else []
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
       "numpy scalars, pathlib paths, omegaconf configs...). ckptfix read them as data without running anything; "
       "`ckptfix convert` writes a copy that loads with weights_only=True.")
def weights_only_refuses(ctx: Context) -> Iterator[Finding]:
    from ckptfix.formats.data_globals import add_safe_globals_line

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
    convertible = all(u.convertible for u in refusing)
    fix = (f"{convert_command(ctx.ckpt.path)} (plain values, listed in the output's record); "
           if convertible else "") + (f"or, if you trust the file: {add_safe_globals_line(names)}" if names else
                                      "or re-save it with torch.save's default pickle_protocol=2")
    yield finding("CKF704", f"torch.load(weights_only=True) refuses this file because of: "
                  f"{', '.join(names + opcodes)}" + (f"; at {listed}{more}" if listed else ""),
                  pytorch="torch.load() raises 'Weights only load failed ... Unsupported global'. weights_only=False "
                  "(or TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1) would run the pickle; ckptfix read it without importing "
                  "or calling anything: these objects are data.", fix=fix)


@check("CKF705", "warning", "an object ckptfix cannot convert to weights-only data",
       "A pickled object whose state only its class can interpret (a custom __setstate__ state, constructor "
       "arguments, an object array): `ckptfix convert` refuses the file rather than guess.")
def not_convertible(ctx: Context) -> Iterator[Finding]:
    for u in _uses(ctx):
        if not u.convertible:
            yield finding("CKF705", u.why_not,
                          pytorch="torch.load(weights_only=True) refuses it; nothing in it was run by ckptfix.",
                          fix="Re-save this value as plain data (dict, list, numbers, tensors) in the training "
                          "script, or allowlist its class with torch.serialization.add_safe_globals if you trust it.")


def _fields(fields: object) -> str:
    text = repr(fields) if fields is not None else ""
    return f": {text[:80]}{'...' if len(text) > 80 else ''}" if text else ""
