"""The `ckptfix` command line: parse arguments, call the library, render. Nothing else lives here."""

from __future__ import annotations

import json
import os
import sys
from typing import Iterable

import click

from ckptfix.errors import CkptfixError

EXIT_CLEAN, EXIT_FINDINGS, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3


def _progress(items: Iterable, total_bytes: int, label: str) -> Iterable:
    """A byte-weighted progress bar on stderr, only when a person is watching."""
    if not sys.stderr.isatty():
        yield from items
        return
    with click.progressbar(length=total_bytes, label=label, file=sys.stderr) as bar:
        for item in items:
            yield item
            bar.update(getattr(item, "nbytes", 0) or getattr(item, "file_size", 0))


def _emit_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ckptfix")
def cli() -> None:
    """Inspect, repair and guard PyTorch training checkpoints that will not resume cleanly.

    Exit codes: 0 clean, 1 error-level findings, 2 bad usage or unreadable input.
    """


@cli.command()
@click.argument("checkpoint", type=click.Path())
@click.option("--tokenizer", "-t", type=click.Path(), help="sentencepiece .model, tokenizer.json or an HF tokenizer folder.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (schema ckptfix.inspect/1).")
@click.option("--scan", is_flag=True, help="Also read tensor bytes: NaN/Inf in weights and moments.")
@click.option("--verify", is_flag=True, help="Also check every zip record against its CRC-32.")
@click.option("--trust-pickle", is_flag=True,
              help="Read pickles that need globals outside the allowlist, as inert records (still never executed).")
def inspect(checkpoint: str, tokenizer: str | None, as_json: bool, scan: bool, verify: bool, trust_pickle: bool) -> None:
    """Report model, optimizer, scheduler and scaler state, and list findings.

    \b
    Examples:
      ckptfix inspect ckpt.pth --tokenizer tok.model
      ckptfix inspect output/checkpoint-500 --tokenizer output/ --json
      ckptfix inspect ckpt.pth --scan --verify
    """
    from ckptfix.inspect import inspect as run_inspect

    report = run_inspect(checkpoint, tokenizer, scan=scan, verify=verify, trust_pickle=trust_pickle,
                         progress=_progress)
    if as_json:
        _emit_json(report.to_json())
    else:
        from ckptfix.render import render_report

        click.echo(render_report(report))
    sys.exit(report.exit_code)


def main(argv: list[str] | None = None) -> None:
    """Entry point: every CkptfixError becomes one line on stderr and exit code 2, never a traceback."""
    try:
        cli.main(args=argv, prog_name="ckptfix", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:  # usage errors
        click.echo(f"ckptfix: error: {exc.format_message()}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except click.exceptions.Abort:
        click.echo("ckptfix: aborted", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except CkptfixError as exc:
        click.echo(f"ckptfix: error: {_one_line(str(exc))}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        click.echo("ckptfix: interrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(EXIT_CLEAN)
    except Exception as exc:  # a bug in ckptfix: still one line, but a distinct code so tests can tell
        if os.environ.get("CKPTFIX_DEBUG"):
            raise
        click.echo(f"ckptfix: internal error: {type(exc).__name__}: {_one_line(str(exc))} "
                   "(set CKPTFIX_DEBUG=1 for a traceback)", err=True)
        sys.exit(EXIT_INTERNAL)


def _one_line(text: str) -> str:
    return " ".join(text.split())


if __name__ == "__main__":
    main()
