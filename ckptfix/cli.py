"""The `ckptfix` command line: parse arguments, call the library, render. Nothing else lives here.

Start-up is kept small on purpose (`bench/startup.py` measures it): `--version` imports neither numpy nor
torch, and every command imports the library it calls inside its own body.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
from typing import Any

import click

from ckptfix import __version__
from ckptfix.errors import CkptfixError, for_cli
from ckptfix.policies import REPAIR_POLICIES
from ckptfix.progress import terminal_progress
from ckptfix.verify import VerifyFailed

EXIT_CLEAN, EXIT_FINDINGS, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, the shell's convention for Ctrl-C


_QUIET = click.option("--quiet", "-q", is_flag=True,
                      help="No progress bar (one is drawn on a terminal for work over a second; never when piped).")
# commands without a progress bar accept -q too, so that every command takes the same flags
_QUIET_ONLY = click.option("--quiet", "-q", is_flag=True, help="Accepted for uniformity: this command draws no progress bar.")


def _color() -> bool | None:
    """click.echo's `color`: None lets click strip styles when stdout is not a terminal; NO_COLOR (any
    non-empty value, https://no-color.org) turns them off everywhere."""
    return False if os.environ.get("NO_COLOR") else None


def _paint(text: str) -> str:
    """Colour the severities and the verdict words of rendered text (click.echo removes them off a terminal)."""
    import re

    colours = {"error": "red", "warning": "yellow", "info": "blue"}

    def severity(m: re.Match[str]) -> str:
        return m.group(1) + click.style(m.group(2), fg=colours[m.group(2)], bold=True) + m.group(3)

    text = re.sub(r"(?m)^(  )(error|warning|info)(\s+CKF\d{3})", severity, text)
    return re.sub(r"(?m)^(wrote|converted|restored)\b", lambda m: click.style(m.group(1), fg="green"), text)


def _remote() -> Any:
    """`ckptfix.remote` when a URL was named in this process (its mirrors' temporary paths are then shown
    as the URLs they stand for), else None."""
    return sys.modules.get("ckptfix.remote")


def _echo(text: str) -> None:
    remote = _remote()
    click.echo(_paint(remote.shown(text) if remote is not None else text), color=_color())


def _check_selectors(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    """As ruff: a selector that matches no finding code is a usage error (exit 2), not an empty selection."""
    from ckptfix.checks import registry

    codes = list(registry())
    for value in values:
        if not any(code.startswith(value.strip().upper()) for code in codes):
            raise click.BadParameter(f"Unknown rule selector: `{value}` (codes look like CKF102; a prefix such as "
                                     "CKF1 selects a family; `ckptfix explain --all` lists them)", ctx, param)
    return values


def _emit_json(data: object) -> None:
    remote = _remote()
    text = json.dumps(data, indent=2, default=str)
    click.echo(text if remote is None else json.dumps(remote.shown_tree(json.loads(text)), indent=2))


_HTML = click.option("--html", type=click.Path(), metavar="PATH",
                     help="Also write the report as one self-contained HTML page (inline SVG charts, no script, "
                     "nothing loaded from elsewhere) to PATH; refused if PATH exists, unless --force.")
_HTML_FORCE = click.option("--force", is_flag=True, help="Replace the --html file if it exists.")


def _check_html(html: str | None, inputs: list[str], force: bool) -> None:
    """Refuse an --html PATH that exists (without --force) or is an input before any work: the HTML module
    (numpy) is imported only when --html is given."""
    if html is not None:
        from ckptfix.html_report import check_target

        check_target(html, inputs, force=force)


def _html_line(html: str | None) -> str:
    if html is None:
        return ""
    from ckptfix.render import _line
    from ckptfix.untrusted import escape

    return "\n" + _line("html", f"wrote {escape(html)}")


VERSION_LINE = f"ckptfix, version {__version__}"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", message=VERSION_LINE)
def cli() -> None:
    """Inspect, repair and guard PyTorch training checkpoints that will not resume cleanly.

    Exit codes: 0 clean, 1 error-level findings, 2 bad usage or unreadable input, 3 an internal error (a
    repaired OUT that does not match its plan is removed and reported so), 130 interrupted.
    Colour on a terminal only; NO_COLOR=1 turns it off.

    \b
    Shell completion (bash; zsh_source or fish_source for those shells):
      eval "$(_CKPTFIX_COMPLETE=bash_source ckptfix)"
    """


@cli.command()
@click.argument("checkpoint", type=click.Path())
@click.option("--tokenizer", "-t", type=click.Path(), help="sentencepiece .model, tokenizer.json or an HF tokenizer folder.")
@click.option("--from-tokenizer", type=click.Path(),
              help="The tokenizer the checkpoint was trained with (if no record or folder says): report moved ids.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (schema ckptfix.inspect/1).")
@click.option("--scan", is_flag=True, help="Also read tensor bytes: NaN/Inf in weights and moments.")
@click.option("--verify", is_flag=True, help="Also check every zip record against its CRC-32.")
@click.option("--trust-pickle", is_flag=True,
              help="Read pickles that need globals outside the allowlist, as inert records (still never executed).")
@click.option("--select", multiple=True, metavar="CODE", callback=_check_selectors,
              help="Report only these codes (a prefix selects a family: CKF1, CKF30). Repeatable, as in ruff; "
              "an unknown code is a usage error (exit 2).")
@click.option("--ignore", multiple=True, metavar="CODE", callback=_check_selectors,
              help="Leave these codes (or prefixes) out. Repeatable.")
@click.option("--batch-size", type=click.IntRange(min=1), help="Trainer resume: the per-device batch size it will use "
              "(CKF314: where the resume starts in the data and the LR schedule). Unset: the saved one.")
@click.option("--grad-accum", type=click.IntRange(min=1), help="Trainer resume: its gradient_accumulation_steps.")
@click.option("--world-size", type=click.IntRange(min=1), help="Trainer resume: its number of processes.")
@click.option("--dataset-length", type=click.IntRange(min=1), help="Trainer resume: the training set's length "
              "(else bounded from trainer_state.json).")
@_HTML
@_HTML_FORCE
@_QUIET
def inspect(checkpoint: str, tokenizer: str | None, from_tokenizer: str | None, as_json: bool, scan: bool, verify: bool,
            trust_pickle: bool, select: tuple[str, ...], ignore: tuple[str, ...], batch_size: int | None,
            grad_accum: int | None, world_size: int | None, dataset_length: int | None, html: str | None, force: bool,
            quiet: bool) -> None:
    """Report model, optimizer, scheduler and scaler state, and list findings.

    \b
    Examples:
      ckptfix inspect ckpt.pth --tokenizer tok.model
      ckptfix inspect output/checkpoint-500 --tokenizer output/ --json
      ckptfix inspect ckpt.pth --scan --verify
      ckptfix inspect output/checkpoint-500 --batch-size 8 --grad-accum 2 --world-size 1
      ckptfix inspect ckpt.pth --tokenizer tok.model --html report.html
    """
    from ckptfix.data_position import ResumeWith
    from ckptfix.inspect import inspect as run_inspect

    _check_html(html, [checkpoint], force)
    given = (batch_size, grad_accum, world_size, dataset_length)
    resume = ResumeWith(*given) if any(v is not None for v in given) else None
    report = run_inspect(checkpoint, tokenizer, scan=scan, verify=verify, trust_pickle=trust_pickle,
                         from_tokenizer=from_tokenizer, progress=terminal_progress(quiet), resume=resume)
    if select or ignore:
        report.select(select, ignore)
    if html is not None:
        from ckptfix.html_report import write_inspect_html

        write_inspect_html(report, html, force=force)
    if as_json:
        _emit_json(report.to_json())
    else:
        from ckptfix.render import render_report

        _echo(render_report(report) + _html_line(html))
    sys.exit(report.exit_code)


@cli.command()
@click.argument("checkpoint", type=click.Path())
@click.option("--tokenizer", "-t", required=True, type=click.Path(), help="The tokenizer the run will use now.")
@click.option("--out", "-o", type=click.Path(), help="Output path (the input's format, or the one its name asks for: .pth <-> .safetensors for weights). Required unless --dry-run.")
@click.option("--from-tokenizer", type=click.Path(),
              help="The tokenizer the checkpoint was trained with: rows move by token string. Default: the one its "
              "ckptfix record or its HF folder holds.")
@click.option("--keep-ids", is_flag=True, help="Keep row i for token i even where the old tokenizer is known or ids look moved.")
@click.option("--keep", multiple=True, metavar="PATH",
              help="A value the audit names (a tensor, a config entry) that is not indexed by this tokenizer's ids "
              "(a separate vocabulary, a count that only happens to equal the vocab size): kept as it is. Repeatable.")
@click.option("--own-rows", type=click.IntRange(min=1), metavar="N",
              help="The embedding's last N rows are the model class's own, past its vocab (MllamaModel: 8 image "
              "rows), where no head tells (CKF107): kept after the tokens, rows = tokens + N.")
@click.option("--policy", type=click.Choice(REPAIR_POLICIES),
              help="Optimizer state: remap moments (default for Adam), fresh (drop state, keep schedule), reset (drop both).")
@click.option("--init", "init", type=click.Choice(["pieces", "mean", "zeros", "normal"]),
              help="New rows: pieces (mean of the old pieces of the token's text; default with --from-tokenizer), "
                   "mean (HF mean_resizing; default otherwise), zeros, or normal with --std.")
@click.option("--std", type=float, default=0.02, show_default=True, help="Standard deviation for --init normal.")
@click.option("--pad-to", "--pad-to-multiple-of", "pad_to_multiple_of", type=click.IntRange(min=1),
              help="Round the row count up to a multiple of N (1: one row per token). Default: the model's size "
              "when the tokenizer fits it (config vocab_size, a round reserve, padding to 64+), else the multiple "
              "the checkpoint had against its old tokenizer, else one row per token; the output names the rule.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for sampled new rows.")
@click.option("--dry-run", is_flag=True, help="Print the plan; write nothing.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists (if OUT is the input, a .bak is kept).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (schema ckptfix.repair/1).")
@click.option("--trust-pickle", is_flag=True, help="Read pickles with globals outside the allowlist as inert records.")
@click.option("--in-place", is_flag=True,
              help="Write only what changes into CHECKPOINT itself (undo: ckptfix restore CHECKPOINT). Formats: DCP "
              "folders, Megatron-Core torch_dist folders, Hugging Face model folders (save_pretrained) and Trainer "
              "checkpoint-N/ folders with safetensors weights; others: repair into a new path with -o.")
@_QUIET
def repair(checkpoint: str, tokenizer: str, out: str | None, from_tokenizer: str | None, keep_ids: bool,
           keep: tuple[str, ...], own_rows: int | None, policy: str | None, init: str | None,
           std: float, pad_to_multiple_of: int | None, seed: int, dry_run: bool, force: bool, as_json: bool,
           trust_pickle: bool, in_place: bool, quiet: bool) -> None:
    """Resize embeddings/heads and their optimizer state to TOKENIZER; write a new resume checkpoint.

    \b
    Examples:
      ckptfix repair ckpt.pth --tokenizer tok.model -o ckpt.fixed.pth
      ckptfix repair ckpt.pth -t new/tokenizer.json --from-tokenizer old/tokenizer.json -o fixed.pth
      ckptfix repair output/checkpoint-500 -t new_tok/ -o repaired/checkpoint-500 --policy fresh
      ckptfix repair ckpt.pth -t tok.model --pad-to 64 --dry-run
      ckptfix repair step-1000/ -t tok.model --in-place      (DCP; undo: ckptfix restore step-1000/)
    """
    from ckptfix.surgery import repair as run_repair
    from ckptfix.surgery.options import RepairOptions

    if out is None and not dry_run and not in_place:
        raise click.UsageError("missing -o/--out (or pass --dry-run)")
    options = RepairOptions(from_tokenizer=from_tokenizer, policy=policy, init=init, std=std,
                            pad_to_multiple_of=pad_to_multiple_of, dry_run=dry_run, force=force,
                            trust_pickle=trust_pickle, seed=seed, in_place=in_place, keep_ids=keep_ids, keep=keep,
                            own_rows=own_rows, progress=terminal_progress(quiet))
    result = run_repair(checkpoint, tokenizer, out, options=options)
    if as_json:
        _emit_json(result.to_json())
    else:
        from ckptfix.render import render_repair

        _echo(render_repair(result))
    _note_trainer_output(checkpoint, out, in_place)


def _note_trainer_output(checkpoint: str, out: str | None, in_place: bool) -> None:
    """One line on stderr when a folder OUT lands among a Trainer's checkpoint-N folders under a name the
    Trainer reads as a step (its resume and rotation would take or delete it): README's "beside the run's
    output_dir, not inside" as a note, not a refusal."""
    from ckptfix.resume_hints import inside_trainer_output
    from ckptfix.untrusted import escape

    if out is None or in_place or not (os.path.isdir(checkpoint) or os.path.isdir(out)):
        return
    note = inside_trainer_output(out)
    if note is not None:
        click.echo(f"ckptfix: note: {escape(note)}", err=True)


@cli.command()
@click.argument("checkpoint", type=click.Path())
@click.option("--out", "-o", type=click.Path(), help="Output .pth. Required unless --dry-run.")
@click.option("--dry-run", is_flag=True, help="List what would be converted; write nothing.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists (if OUT is the input, a .bak is kept).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (schema ckptfix.convert/1).")
@_QUIET_ONLY
def convert(checkpoint: str, out: str | None, dry_run: bool, force: bool, as_json: bool, quiet: bool) -> None:
    """Write a copy of a torch.save file that torch.load(weights_only=True) loads.

    Pickled data objects (argparse.Namespace, numpy scalars and arrays, pathlib paths, datetime, deque,
    omegaconf configs, dataclasses...) become plain dicts, lists, numbers, strings and tensors; tensors
    are copied byte for byte. A file whose pickle calls code is refused (exit 2); nothing is run.

    \b
    Examples:
      ckptfix convert last.pth -o last.weights_only.pth
      ckptfix convert checkpoint-500/rng_state.pth -o checkpoint-500/rng_state.pth --force
      ckptfix convert epoch=3.ckpt --dry-run
    """
    from ckptfix.weights_only import convert as run_convert

    if out is None and not dry_run:
        raise click.UsageError("missing -o/--out (or pass --dry-run)")
    result = run_convert(checkpoint, out, dry_run=dry_run, force=force)
    if as_json:
        _emit_json(result.to_json())
    else:
        from ckptfix.render import render_convert

        _echo(render_convert(result))


@cli.command()
@click.argument("a", type=click.Path())
@click.argument("b", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (schema ckptfix.diff/1).")
@click.option("--atol", type=click.FloatRange(min=0.0), default=0.0, show_default=True,
              help="Count a tensor as changed only if some value moved by more than this.")
@click.option("--trust-pickle", is_flag=True, help="Read pickles with globals outside the allowlist as inert records.")
@click.option("--tokenizer", type=click.Path(), default=None,
              help="B's tokenizer: say per new token whether its embedding and head rows learned, and why not.")
@_HTML
@_HTML_FORCE
@_QUIET
def diff(a: str, b: str, as_json: bool, atol: float, trust_pickle: bool, tokenizer: str | None, html: str | None,
         force: bool, quiet: bool) -> None:
    """Compare checkpoint A (earlier) with B (later): which tensors changed, and are weights moving?

    Exit code 0 when trainable weights changed, or when both are saved at the same step (no training lies
    between them: a copy or a repaired copy; the verdict says so); 1 when training between two different (or
    unknown) steps changed no trainable weight, or a new token's rows did not learn (--tokenizer: tokens added
    past the base vocabulary or past A's rows; a frozen table, a token never in the data); 2 for unreadable input.

    \b
    Examples:
      ckptfix diff ckpt-step1000.pth ckpt-step2000.pth
      ckptfix diff resized/ output/checkpoint-50 --tokenizer output/checkpoint-50
      ckptfix diff output/checkpoint-500 output/checkpoint-1000 --json
      ckptfix diff run/epoch=1.ckpt run/epoch=2.ckpt --atol 1e-6
      ckptfix diff ckpt-step1000.pth ckpt-step2000.pth --html diff.html
    """
    from ckptfix.compare import diff as run_diff

    _check_html(html, [a, b], force)
    report = run_diff(a, b, atol=atol, progress=terminal_progress(quiet), trust_pickle=trust_pickle, tokenizer=tokenizer)
    if html is not None:
        from ckptfix.html_report import write_diff_html

        write_diff_html(report, html, force=force, trust_pickle=trust_pickle, tokenizer=tokenizer)
    if as_json:
        _emit_json(report.to_json())
    else:
        from ckptfix.render import render_diff

        _echo(render_diff(report) + _html_line(html))
    sys.exit(report.exit_code)


@cli.command()
@click.argument("folder", type=click.Path())
@_QUIET_ONLY
def restore(folder: str, quiet: bool) -> None:
    """Undo `ckptfix repair --in-place` on FOLDER: the previous metadata/index back, the added files removed.

    \b
    Example:
      ckptfix restore checkpoints/step-1000
    """
    from ckptfix.surgery.undo import restore as run_restore

    for line in run_restore(folder):
        _echo(line)


@cli.command()
@click.argument("run_dir", type=click.Path())
@click.option("--scan", is_flag=True, help="Also read tensor bytes: every torch.save record against its CRC-32.")
@_QUIET_ONLY
def latest(run_dir: str, scan: bool, quiet: bool) -> None:
    """Print the newest checkpoint in RUN_DIR that is complete and whole (a save cut short is skipped).

    Candidates: Trainer checkpoint-N/, Lightning *.ckpt, DCP step-N/, Megatron iter_N/, DeepSpeed
    global_stepN/. Only structure is read: the files a resume reads are there, non-empty, and parse.
    Exit 0 with the path on stdout; 1 when none is whole (each newer candidate and why on stderr);
    2 when RUN_DIR is not a folder.

    \b
    Examples:
      ckptfix latest output/
      python train.py --resume_from_checkpoint "$(ckptfix latest output/)"
      ckptfix latest lightning_logs/version_0/checkpoints --scan
    """
    from ckptfix.latest import latest_checkpoint, tracker_note
    from ckptfix.untrusted import escape

    result = latest_checkpoint(run_dir, scan=scan)
    for cand in result.skipped:
        click.echo(f"ckptfix: skipped {escape(cand.path)}: {'; '.join(cand.reasons)}", err=True)
    chosen = result.chosen
    if chosen is not None:
        for note in chosen.notes:
            click.echo(f"ckptfix: note: {escape(chosen.path)}: {note}", err=True)
    if (tracker := tracker_note(result.run_dir, chosen)) is not None:
        click.echo(f"ckptfix: note: {escape(tracker)}", err=True)
    if result.path is None:
        what = "no whole checkpoint" if result.checked else "no checkpoint (checkpoint-N/, *.ckpt, step-N/, iter_N/, global_stepN/)"
        click.echo(f"ckptfix: {what} in {escape(run_dir)}", err=True)
        sys.exit(EXIT_FINDINGS)
    click.echo(result.path)


EXPLAIN_SCHEMA = "ckptfix.explain/1"


@cli.command()
@click.argument("codes", nargs=-1, metavar="[CODE]...")
@click.option("--all", "show_all", is_flag=True, help="Every code, checkpoint findings then the guard's.")
@click.option("--json", "as_json", is_flag=True, help=f"Print the codes as JSON (schema {EXPLAIN_SCHEMA}).")
@_QUIET_ONLY
def explain(codes: tuple[str, ...], show_all: bool, as_json: bool, quiet: bool) -> None:
    """Print what finding codes (CKF1xx-7xx) or guard codes (CKF8xx) mean.

    \b
    Examples:
      ckptfix explain CKF120
      ckptfix explain ckf822 CKF102
      ckptfix explain --all --json
    """
    from ckptfix.checks import registry

    known = {**registry(), **registry(guard=True)}
    if show_all == bool(codes):
        raise click.UsageError("name one or more codes, or pass --all")
    wanted = list(known) if show_all else [c.strip().upper() for c in codes]
    for code in wanted:
        if code not in known:
            raise click.UsageError(f"unknown code {code!r} (codes look like CKF101; `ckptfix explain --all` lists them)")
    specs = [known[c] for c in wanted]
    if as_json:
        guard = registry(guard=True)
        _emit_json({"schema": EXPLAIN_SCHEMA, "codes": [
            {"code": s.code, "severity": s.severity, "title": s.title, "doc": " ".join(s.doc.split()),
             "source": "guard" if s.code in guard else "checkpoint"} for s in specs]})
        return
    _echo("\n\n".join(f"{s.code} ({s.severity}): {s.title}\n{s.doc}" for s in specs))


class _Terminated(BaseException):
    """SIGTERM (a job scheduler's kill, `timeout`), raised like Ctrl-C so a write in progress removes
    its temp file on the way out."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated()


def main(argv: list[str] | None = None) -> None:
    """Entry point: every CkptfixError becomes one line on stderr and exit code 2, never a traceback.
    Under --json the same error is also printed on stdout as a JSON object (`_emit_error`)."""
    args = sys.argv[1:] if argv is None else list(argv)
    previous = _install(signal.SIGTERM, _on_sigterm)
    thresholds = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_OBJECTS, *thresholds[1:])
    try:
        cli.main(args=args, prog_name="ckptfix", standalone_mode=False)
    except _Terminated:
        click.echo("ckptfix: terminated", err=True)
        sys.exit(128 + signal.SIGTERM)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:  # usage errors
        _fail(args, "usage", exc.format_message())
    except KeyboardInterrupt:
        _interrupted(args)
    except click.exceptions.Abort as exc:
        if isinstance(exc.__context__, KeyboardInterrupt):  # click turns Ctrl-C into Abort
            _interrupted(args)
        _fail(args, "aborted", "aborted", prefix="ckptfix: aborted")
    except CkptfixError as exc:
        _fail(args, "bad_input", _one_line(for_cli(_changed_input(exc))))
    except VerifyFailed as exc:  # OUT was not what the plan said: taken back, a bug to report (exit 3)
        message = _one_line(str(exc))
        _fail(args, "verify", message, code=EXIT_INTERNAL, prefix=f"ckptfix: error: verify failed: {message}")
    except BrokenPipeError:
        sys.exit(EXIT_CLEAN)
    except Exception as exc:  # a bug in ckptfix: still one line, but a distinct code so tests can tell
        if os.environ.get("CKPTFIX_DEBUG"):
            raise
        message = f"{type(exc).__name__}: {_one_line(str(exc))}"
        _fail(args, "internal", message, code=EXIT_INTERNAL,
              prefix=f"ckptfix: internal error: {message} (set CKPTFIX_DEBUG=1 for a traceback)")
    finally:
        gc.set_threshold(*thresholds)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


#: The cyclic collector's young-generation threshold while a command runs (Python's default: 700). A reader builds
#: its trees (a header's JSON, an unpickled state dict, one record per tensor) in one go and keeps them: at 700,
#: collections that find nothing took 35-55% of inspect's CPU on 150,000 optimizer steps or 300,000 safetensors
#: entries (bench/hostile_scale.py). Garbage is still collected, every 100,000 new containers. The CLI owns its
#: process; the Python API leaves the caller's collector alone.
GC_YOUNG_OBJECTS = 100_000


def _changed_input(exc: CkptfixError) -> str:
    """An object-store input replaced while it was read looks corrupt to the readers (bytes of two versions):
    say that instead, when the store shows it (a listing per mirror, only on this error path)."""
    remote = sys.modules.get("ckptfix.remote")
    if remote is not None:
        try:
            return remote.changed_inputs_line() or str(exc)
        except CkptfixError:
            pass
    return str(exc)


ERROR_SCHEMA = "ckptfix.error/1"


def _fail(args: list[str], kind: str, message: str, *, code: int = EXIT_BAD_INPUT, prefix: str | None = None) -> None:
    """One line on stderr, then exit `code`. Under --json, stdout also gets
    `{"schema": "ckptfix.error/1", "error": {"kind", "message", "exit_code"}}`, so a script that parses
    stdout sees an object instead of nothing (kind: usage, bad_input, aborted, verify or internal)."""
    remote = _remote()
    if remote is not None:  # a mirror's temporary path named as its URL
        message = remote.shown(message)
        prefix = remote.shown(prefix) if prefix is not None else None
    click.echo(prefix or f"ckptfix: error: {message}", err=True)
    if _wants_json(args):
        click.echo(json.dumps({"schema": ERROR_SCHEMA, "error": {"kind": kind, "message": message, "exit_code": code}}))
    sys.exit(code)


def _interrupted(args: list[str]) -> None:
    """Ctrl-C: exit 130 as shells expect (a write in progress has removed its temp file on the way out)."""
    _fail(args, "aborted", "interrupted", code=EXIT_INTERRUPTED, prefix="ckptfix: interrupted")


def _wants_json(args: list[str]) -> bool:
    """Whether --json is among the options (not after `--`, where it would be a file name)."""
    return "--json" in (args[:args.index("--")] if "--" in args else args)


def _install(signum: int, handler: Any) -> Any:
    """Set a signal handler where that is possible (only the main thread may); the previous one, or None."""
    try:
        return signal.signal(signum, handler)
    except ValueError:
        return None


def _one_line(text: str) -> str:
    from ckptfix.untrusted import escape

    return escape(" ".join(text.split()))  # messages quote file names and values from the input


if __name__ == "__main__":
    main()
