"""Issue 46, item 3: repair's options are one value, `RepairOptions`, checked once where it is made.

The public `ckptfix.repair(...)` keywords, the `ckptfix repair` options and the dataclass's fields are the same
set (checked here, so they cannot drift), a bad option is refused when the value is made with the message
the API and the CLI give, and no function on the way from `repair` to the writers takes the options one by one
again (an ast check over `ckptfix/surgery/` and `ckptfix/publish.py`).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

import ckptfix
from ckptfix.cli import cli, main
from ckptfix.surgery.options import RepairOptions

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "fixtures" / "seed001"
FIELDS = {f.name: f for f in dataclasses.fields(RepairOptions)}
# the CLI's spelling of an option where it is not the field's name: --quiet chooses the progress reporter
CLI_SPELLING = {"progress": "quiet"}
# what `ckptfix repair` takes that is no repair option: the paths, and how the result is printed
CLI_ONLY = {"checkpoint", "tokenizer", "out", "as_json"}
# "a handful": more option names than this in one signature or call means options are forwarded one by one
MOST_OPTIONS_BY_NAME = 4

BAD = [
    ({"policy": "bogus"}, "unknown --policy 'bogus' (choose remap, fresh, reset)"),
    ({"init": "gauss"}, "unknown --init 'gauss' (choose pieces, mean, zeros, normal)"),
    ({"pad_to_multiple_of": 0}, "--pad-to-multiple-of must be a positive integer"),
    ({"std": 0.0}, "--std must be a positive number, not 0.0"),
    ({"std": -0.5}, "--std must be a positive number, not -0.5"),
    ({"std": float("nan")}, "--std must be a positive number, not nan"),
    ({"seed": -1}, "--seed must be a non-negative integer, not -1"),
    ({"own_rows": 0}, "--own-rows must be a positive integer, not 0"),
]


def test_options_are_one_frozen_hashable_value():
    options = RepairOptions(policy="fresh", keep=["a.weight"])  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.policy = "reset"  # type: ignore[misc]
    assert options.keep == ("a.weight",) and hash(options) == hash(RepairOptions(policy="fresh", keep=("a.weight",)))
    assert RepairOptions(policy="fresh-optimizer").policy == "fresh-optimizer"  # the alias is accepted


@pytest.mark.parametrize(("kwargs", "message"), BAD, ids=[next(iter(k)) + "=" + repr(next(iter(k.values()))) for k, _ in BAD])
def test_a_bad_option_is_refused_when_made_with_the_apis_message(kwargs, message, tmp_path):
    with pytest.raises(ckptfix.RepairError) as made:
        RepairOptions(**kwargs)
    assert str(made.value) == message
    # the paths do not exist: the option is refused before anything is read
    with pytest.raises(ckptfix.RepairError) as api:
        ckptfix.repair(tmp_path / "missing.pth", tmp_path / "missing.model", tmp_path / "out.pth", **kwargs)
    assert str(api.value) == message


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--std", "0", "--std must be a positive number, not 0.0"),
    ("--std", "nan", "--std must be a positive number, not nan"),
    ("--seed", "-1", "--seed must be a non-negative integer, not -1"),
])
def test_the_cli_gives_the_same_line(flag, value, message, tmp_path, capsys):
    """Options click lets through (its own types refuse --policy bogus, --pad-to 0, --own-rows 0 first)."""
    with pytest.raises(SystemExit) as exited:
        main(["repair", str(tmp_path / "missing.pth"), "-t", str(tmp_path / "missing.model"), "-o",
              str(tmp_path / "out.pth"), flag, value])
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"ckptfix: error: {message}\n"


def test_every_option_is_a_repair_keyword_and_a_cli_option_with_its_default():
    keywords = {name: p for name, p in inspect.signature(ckptfix.repair).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "options"}
    assert set(keywords) == set(FIELDS)
    for name, param in keywords.items():
        assert param.default == FIELDS[name].default, name
    command = cli.commands["repair"]
    spelled = {CLI_SPELLING.get(name, name): name for name in FIELDS}
    assert {p.name for p in command.params} == set(spelled) | CLI_ONLY
    # what the command receives when a flag is not given is the library's default
    parsed = command.make_context("repair", ["ckpt.pth", "-t", "tok.model", "-o", "out.pth"]).params
    for cli_name, name in spelled.items():
        if name not in CLI_SPELLING:
            assert parsed[cli_name] == FIELDS[name].default, name


def test_repair_takes_the_options_whole():
    src, tok = SEED / "ckpt.pth", SEED / "tokenizer.model"
    by_keyword = ckptfix.repair(src, tok, dry_run=True, policy="fresh", init="zeros")
    whole = ckptfix.repair(src, tok, options=ckptfix.RepairOptions(dry_run=True, policy="fresh", init="zeros"))
    assert whole.to_json() == by_keyword.to_json()
    assert (whole.plan.policy, whole.plan.init) == ("fresh", "zeros")
    with pytest.raises(TypeError, match="not both"):
        ckptfix.repair(src, tok, dry_run=True, options=ckptfix.RepairOptions())


def _option_names_taken(node: ast.AST) -> tuple[str, set[str]] | None:
    """(what, option names) for a function's parameters or a call's keyword arguments; None otherwise."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        args = node.args
        names = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
        return f"def {node.name}", names & set(FIELDS)
    if isinstance(node, ast.Call) and ast.unparse(node.func) != "RepairOptions":  # building one names them all
        return f"call {ast.unparse(node.func)}", {k.arg for k in node.keywords if k.arg} & set(FIELDS)
    return None


def test_no_function_on_the_repair_path_forwards_the_options_one_by_one():
    files = sorted((ROOT / "ckptfix" / "surgery").glob("*.py")) + [ROOT / "ckptfix" / "publish.py"]
    crowded = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            taken = _option_names_taken(node)
            if taken is None or len(taken[1]) <= MOST_OPTIONS_BY_NAME:
                continue
            if path.name == "__init__.py" and taken[0] == "def repair":  # the public keywords users call
                continue
            crowded.append(f"{path.relative_to(ROOT)}:{node.lineno} {taken[0]}: {sorted(taken[1])}")
    assert crowded == []
