"""Regenerate the docs' screenshots of the HTML report: docs/img/inspect-report.png and docs/img/diff-report.png.

    python -m bench.html_screenshots          (needs Debian's chromium: apt-get install -y chromium)

The runs are real (tests/html_runs.py): a TinyLM whose data never held ids 600-659, padded to 64 rows past a
BPE tokenizer with added and special tokens (inspect); a 300-row run repaired to 3 more tokens and trained on
(diff). Each page is written by the command line with --html and rendered by headless Chromium.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
MAX_BYTES = 300_000


def shoot(page: Path, png: Path, height: int) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium not found: apt-get install -y chromium")
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--screenshot={png}",
                    f"--window-size=1200,{height}", page.as_uri()], capture_output=True, check=True, timeout=180)
    size = png.stat().st_size
    assert size < MAX_BYTES, f"{png}: {size} bytes"
    print(f"wrote {png.relative_to(ROOT)} ({size // 1000} KB)")


def ckptfix(*args: object, cwd: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "ckptfix", *map(str, args), "-q"], cwd=cwd, capture_output=True, text=True)
    assert done.returncode in (0, 1), done.stderr


def main() -> None:
    from html_runs import new_tokens_pair, showcase

    out = ROOT / "docs" / "img"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ckpt, tok = showcase(work / "show")
        ckptfix("inspect", ckpt.name, "--tokenizer", tok.name, "--html", "report.html", cwd=ckpt.parent)
        shoot(ckpt.parent / "report.html", out / "inspect-report.png", 1250)
        a, b = new_tokens_pair(work / "pair")
        ckptfix("diff", a.name, b.name, "--html", "diff.html", cwd=a.parent)
        shoot(a.parent / "diff.html", out / "diff-report.png", 1250)


if __name__ == "__main__":
    main()
