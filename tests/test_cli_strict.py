"""Issue 33, item 7: a command line as strict and quick as ruff's. Unknown --select/--ignore codes are usage
errors (exit 2), `-V`/`--version`, Ctrl-C exits 130, `-q` on every command, `explain` of several codes, of
`--all`, as JSON, `diff` of two same-step checkpoints agrees with its help, colour only on a terminal and
never with NO_COLOR, completion named in --help, `--in-place` help names every format it supports.
(Speed is measured by bench/startup.py, not asserted here.)"""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli_ux import run_cli

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "fixtures" / "seed001"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}




@pytest.mark.parametrize("flag", ["--select", "--ignore"])
def test_unknown_rule_selector_is_a_usage_error(flag, capsys):
    code, out, err = run_cli(["inspect", str(SEED / "ckpt.pth"), flag, "FOO"], capsys)
    assert (code, out) == (2, "")
    assert err == (f"ckptfix: error: Invalid value for '{flag}': Unknown rule selector: `FOO` (codes look like "
                   "CKF102; a prefix such as CKF1 selects a family; `ckptfix explain --all` lists them)\n")
    code, _, _ = run_cli(["inspect", str(SEED / "ckpt.pth"), "-t", str(SEED / "tokenizer.model"), flag, "ckf1"],
                         capsys)
    assert code in (0, 1)  # a prefix of real codes, any case


def test_version_flags(capsys):
    for flag in ("-V", "--version"):
        res = subprocess.run([sys.executable, "-m", "ckptfix", flag], capture_output=True, text=True, env=ENV)
        assert (res.returncode, res.stdout) == (0, "ckptfix, version 0.1.0\n")
        assert run_cli([flag], capsys)[:2] == (0, "ckptfix, version 0.1.0\n")  # click's own, same line


def test_ctrl_c_exits_130(capsys, monkeypatch):
    from importlib import import_module

    module = import_module("ckptfix.inspect")  # the module (`ckptfix.inspect` the attribute is the function)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "inspect", interrupted)
    code, _, err = run_cli(["inspect", str(SEED / "ckpt.pth")], capsys)
    assert (code, err.splitlines()[-1]) == (130, "ckptfix: interrupted")


def test_a_real_sigint_exits_130():
    code = ("import sys, time; import ckptfix.compare as c\n"
            "def slow(*a, **k):\n    print('ready', flush=True); time.sleep(60)\n"
            "c.diff = slow\nfrom ckptfix.cli import main\nmain(sys.argv[1:])")
    # SIGINT back to its default in the child: a suite started in the background (`cmd &` from a script) runs
    # with SIGINT ignored, which the child would inherit, and Python then installs no KeyboardInterrupt
    proc = subprocess.Popen([sys.executable, "-c", code, "diff", str(SEED / "ckpt.pth"), str(SEED / "ckpt.pth")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "ckptfix: interrupted"


def test_quiet_is_accepted_everywhere(tmp_path, capsys):
    assert run_cli(["explain", "-q", "CKF102"], capsys)[0] == 0
    assert run_cli(["convert", "-q", str(SEED / "ckpt.pth"), "--dry-run"], capsys)[0] == 0
    code, _, err = run_cli(["restore", "-q", str(tmp_path)], capsys)
    assert code == 2 and "No such option" not in err


def test_explain_many_all_and_json(capsys):
    code, out, _ = run_cli(["explain", "CKF102", "ckf822"], capsys)
    assert code == 0 and out.startswith("CKF102 (error): ") and "\n\nCKF822 (error): " in out
    code, out, _ = run_cli(["explain", "--all", "--json"], capsys)
    data = json.loads(out)
    from ckptfix.checks import registry

    assert data["schema"] == "ckptfix.explain/1"
    assert [c["code"] for c in data["codes"]] == [*registry(), *registry(guard=True)]
    assert {c["source"] for c in data["codes"]} == {"checkpoint", "guard"}
    assert set(data["codes"][0]) == {"code", "severity", "title", "doc", "source"}
    code, out, _ = run_cli(["explain", "--all"], capsys)
    assert code == 0 and out.count(" (error): ") + out.count(" (warning): ") + out.count(" (info): ") == len(data["codes"])
    assert run_cli(["explain"], capsys)[0] == 2  # neither a code nor --all


def test_diff_help_says_what_same_step_does(capsys):
    code, out, _ = run_cli(["diff", "--help"], capsys)
    assert code == 0 and "or when both are saved at the same step" in " ".join(out.split())
    code, out, _ = run_cli(["diff", str(SEED / "ckpt.pth"), str(SEED / "ckpt.pth")], capsys)
    assert code == 0 and "same step (step 48 in both)" in out  # what the help says


def _in_a_terminal(args, **env):
    primary, secondary = pty.openpty()
    proc = subprocess.run([sys.executable, "-m", "ckptfix", *args], stdout=secondary, stderr=subprocess.PIPE,
                          env={**ENV, **env}, timeout=120)
    os.close(secondary)
    chunks = []
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(primary)
    return proc.returncode, b"".join(chunks).decode()


def test_colour_on_a_terminal_only_and_never_with_no_color():
    args = ["inspect", str(SEED / "ckpt.pth"), "-t", str(SEED / "tokenizer.model")]
    env = {k: v for k, v in ENV.items() if k != "NO_COLOR"}
    code, out = _in_a_terminal(args, NO_COLOR="")
    assert code == 1 and "\x1b[31m\x1b[1merror\x1b[0m   CKF102" in out
    code, out = _in_a_terminal(args, NO_COLOR="1")
    assert code == 1 and "\x1b[" not in out and "  error   CKF102" in out
    piped = subprocess.run([sys.executable, "-m", "ckptfix", *args], capture_output=True, text=True, env=env)
    assert "\x1b[" not in piped.stdout and "  error   CKF102" in piped.stdout


def test_help_names_completion_and_every_in_place_format(capsys):
    from ckptfix.surgery import IN_PLACE_FORMATS

    _, out, _ = run_cli(["--help"], capsys)
    assert "_CKPTFIX_COMPLETE=bash_source ckptfix" in out and "NO_COLOR" in out
    _, out, _ = run_cli(["repair", "--help"], capsys)
    text = " ".join(out.split())
    names = {"dcp": "DCP folders", "megatron": "Megatron-Core torch_dist folders",
             "hf-model": "Hugging Face model folders", "hf-trainer": "Trainer checkpoint-N/"}
    assert set(names) == set(IN_PLACE_FORMATS) and all(v in text for v in names.values())


def test_completion_script_is_generated():
    res = subprocess.run([sys.executable, "-c", "from ckptfix.cli import cli; cli(prog_name='ckptfix')"],
                         env={**ENV, "_CKPTFIX_COMPLETE": "bash_source"}, capture_output=True, text=True)
    assert res.returncode == 0 and "_ckptfix_completion" in res.stdout
