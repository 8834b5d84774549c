"""The public verbs stay functions whatever ran before: no module is named like one (`ckptfix.compare`
holds `diff`), so importing it cannot replace `ckptfix.diff` in the package namespace."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_verbs_are_functions_after_the_commands_ran(tmp_path):
    from ckpt_factory import trained_checkpoint

    a = trained_checkpoint(tmp_path / "a.pth", 30, steps=1)
    b = trained_checkpoint(tmp_path / "b.pth", 30, steps=2)
    code = textwrap.dedent(f"""
        from ckptfix.cli import main
        for argv in (["diff", {str(a)!r}, {str(b)!r}], ["inspect", {str(a)!r}]):
            try:
                main(argv)
            except SystemExit:
                pass
        from ckptfix import diff, inspect, repair
        import ckptfix
        assert callable(diff) and type(diff).__name__ == "function", diff
        assert callable(inspect) and type(inspect).__name__ == "function", inspect
        assert callable(repair) and type(repair).__name__ == "function", repair
        assert ckptfix.diff is diff
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr
