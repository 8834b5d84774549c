"""`ckptfix` and `python -m ckptfix`: the command line's entry point.

`--version`/`-V` alone is answered here, before click and the command tree are imported (the whole
process stays near a bare interpreter's start-up; `bench/startup.py` measures it); everything else goes
to `ckptfix.cli.main`.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    import sys

    args = sys.argv[1:] if argv is None else list(argv)
    if args in (["--version"], ["-V"]):
        from ckptfix import __version__

        print(f"ckptfix, version {__version__}")  # the line click's --version prints (ckptfix.cli.VERSION_LINE)
        return
    from ckptfix.cli import main as cli_main

    cli_main(args)


if __name__ == "__main__":
    main()
