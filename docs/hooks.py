"""mkdocs hook (mkdocs.yml `hooks:`): what the site shows that is generated when it is built.

- cli.md: the `<!-- cli-help -->` marker becomes each command's `--help`, from click itself.
- security.md: the `<!-- include SECURITY.md -->` marker becomes the repository's SECURITY.md (the reference;
  on GitHub the page links to it instead), its title left out and its headings one level down.
- api.md: the `<!-- api -->` marker becomes one mkdocstrings `::: ckptfix.NAME` block per name of
  `ckptfix.__all__` (the exceptions, the verbs and their result types; `__version__` aside).
- A link out of docs/ to SECURITY.md (`../SECURITY.md`, which works on GitHub) points at the security page.

tests/test_docs.py calls `cli_markdown` and `page_markdown` directly; mkdocs is not needed for that.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLI_MARKER = "<!-- cli-help -->"
SECURITY_MARKER = "<!-- include SECURITY.md -->"
API_MARKER = "<!-- api -->"


def cli_markdown(width: int = 100) -> str:
    """`ckptfix --help` and every command's `--help`, as click prints them, one section each."""
    import click

    from ckptfix.cli import cli

    def help_of(command: click.Command, name: str, parent: click.Context | None) -> str:
        ctx = click.Context(command, info_name=name, parent=parent, terminal_width=width, max_content_width=width)
        return command.get_help(ctx)

    root = click.Context(cli, info_name="ckptfix", terminal_width=width, max_content_width=width)
    parts = ["### ckptfix", "", "```text", help_of(cli, "ckptfix", None), "```"]
    for name in cli.list_commands(root):
        command = cli.get_command(root, name)
        assert command is not None, name
        parts += ["", f"### ckptfix {name}", "", "```text", help_of(command, name, root), "```"]
    return "\n".join(parts) + "\n"


def api_markdown() -> str:
    """One mkdocstrings directive per public name, in `ckptfix.__all__`'s order."""
    import ckptfix

    return "\n\n".join(f"::: ckptfix.{name}" for name in ckptfix.__all__ if name != "__version__") + "\n"


def _security_markdown() -> str:
    text = (ROOT / "SECURITY.md").read_text(encoding="utf-8")
    text = re.sub(r"\A# .*\n", "", text)  # its title: the page has its own
    return re.sub(r"(?m)^(#+) ", r"#\1 ", text)


def page_markdown(markdown: str, src_uri: str) -> str:
    if src_uri == "cli.md":
        markdown = markdown.replace(CLI_MARKER, cli_markdown())
    if src_uri == "api.md":
        markdown = markdown.replace(API_MARKER, api_markdown())
    if src_uri == "security.md":
        markdown = markdown.replace(SECURITY_MARKER, _security_markdown())
    return markdown.replace("](../SECURITY.md)", "](security.md)")


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (mkdocs' hook signature)
    return page_markdown(markdown, page.file.src_uri)
