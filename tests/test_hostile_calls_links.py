"""Hostile inputs, round 3 (issue 28, items 1-4): each class through the real CLI, with the exact exit code and line.

1. `copyreg._reconstructor(Popen, Popen, argv)` runs `Popen.__init__(argv)` under pickle.load (shown live here, in a
   subprocess that creates a sentinel); ckptfix refuses it in every carrier and never prints an add_safe_globals
   line for it, even when asked to read it as inert records (--trust-pickle: CKF706, an error).
2. `repair --in-place` never writes through a link planted in the folder under any name it uses.
3. A file below an input folder that links out of it is never read (an index shard, a DCP data file, a
   tokenizer folder's merges.txt), so its bytes never reach a report or OUT.
4. `restore` reads its list like any input and refuses one that would delete what the restored metadata needs.
"""

from __future__ import annotations

import argparse
import copyreg
import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt_factory import new_run, train
from tokenizer_factory import make_hf_tokenizer_folder, train_bpe_tokenizer_json

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptfix.cli", *map(str, args)], capture_output=True, text=True,
                          env=ENV, timeout=300)


def snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every entry below `folder`: a file's bytes, a link's text (links never followed)."""
    out: dict[str, bytes | str] = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        out[rel] = ("link:" + os.readlink(p)) if p.is_symlink() else p.read_bytes() if p.is_file() else "dir"
    return out


# --- 1. copyreg._reconstructor with a base that runs code --------------------------------------------

class Payload:
    """Pickles as `copyreg._reconstructor(subprocess.Popen, subprocess.Popen, ["touch", sentinel])`."""

    def __init__(self, sentinel: str):
        self.sentinel = sentinel

    def __reduce__(self):
        return copyreg._reconstructor, (subprocess.Popen, subprocess.Popen, ["touch", self.sentinel])


def _refusal(shown: str, sentinel: str) -> str:
    brief = repr(sentinel[:60]) + ("..." if len(sentinel) > 60 else "")  # as the message cuts a long string
    return (f"ckptfix: error: {shown}: refusing to unpickle: it needs globals outside the safe allowlist "
            f"(copyreg._reconstructor, subprocess.Popen); loading it would call subprocess.Popen.__init__(<new "
            f"subprocess.Popen>, ('touch', {brief})); loading it could execute code. Pass --trust-pickle only "
            "if you trust its author.")


def test_the_payload_is_live_under_pickle_load(tmp_path):
    sentinel = tmp_path / "RAN"
    (tmp_path / "p.pkl").write_bytes(pickle.dumps({"x": Payload(str(sentinel))}, protocol=2))
    subprocess.run([sys.executable, "-c", "import pickle,sys,time; pickle.load(open(sys.argv[1],'rb')); "
                    "time.sleep(0.5)", str(tmp_path / "p.pkl")], check=True, timeout=60)
    assert sentinel.exists()  # what ckptfix must never call data


def _carriers(tmp_path: Path, sentinel: str) -> dict[str, tuple[Path, str]]:
    """The seven carriers: (path given to inspect, the file named in the refusal)."""
    state = {"model": {"w": torch.zeros(4, 2)}}
    out: dict[str, tuple[Path, str]] = {}
    torch.save({**state, "x": Payload(sentinel)}, tmp_path / "zip.pth")
    out["torch zip"] = (tmp_path / "zip.pth", str(tmp_path / "zip.pth"))
    torch.save({**state, "x": Payload(sentinel)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    out["legacy"] = (tmp_path / "legacy.pt", str(tmp_path / "legacy.pt"))
    (tmp_path / "p4.pt").write_bytes(pickle.dumps({"x": Payload(sentinel)}, protocol=4))  # STACK_GLOBAL
    out["protocol 4"] = (tmp_path / "p4.pt", str(tmp_path / "p4.pt"))
    ns = argparse.Namespace(lr=1e-3, hook=Payload(sentinel))
    torch.save({**state, "args": ns}, tmp_path / "ns.pth")
    out["inside a Namespace"] = (tmp_path / "ns.pth", str(tmp_path / "ns.pth"))
    torch.save({"state_dict": state["model"], "hyper_parameters": {"vocab_size": 4, "cb": Payload(sentinel)},
                "pytorch-lightning_version": "2.4.0", "epoch": 0, "global_step": 1}, tmp_path / "last.ckpt")
    out["Lightning hparams"] = (tmp_path / "last.ckpt", str(tmp_path / "last.ckpt"))
    for name in ("optimizer.pt", "scheduler.pt"):
        folder = tmp_path / f"hf-{name[:-3]}" / "checkpoint-1"
        folder.mkdir(parents=True)
        from safetensors.torch import save_file

        save_file({"w": torch.zeros(4, 2)}, folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps({"vocab_size": 4, "model_type": "llama"}))
        torch.save({"state": {}, "param_groups": [], "x": Payload(sentinel)}, folder / name)
        out[f"HF {name}"] = (folder, str(folder / name))
    return out


def test_every_carrier_is_refused_with_the_call_it_would_make(tmp_path):
    sentinel = str(tmp_path / "RAN")
    for carrier, (path, shown) in _carriers(tmp_path, sentinel).items():
        res = cli("inspect", path)
        assert (res.returncode, res.stdout) == (2, ""), (carrier, res)
        assert res.stderr.strip() == _refusal(shown, sentinel), (carrier, res.stderr)
        assert "add_safe_globals" not in res.stdout + res.stderr
    assert not Path(sentinel).exists()


def test_read_as_inert_records_it_is_an_error_and_no_allowlist_is_offered(tmp_path):
    sentinel = str(tmp_path / "RAN")
    path = _carriers(tmp_path, sentinel)["torch zip"][0]
    res = cli("inspect", path, "--trust-pickle", "--json")
    assert res.returncode == 1, res.stderr
    report = json.loads(res.stdout)
    codes = {f["code"]: f for f in report["findings"]}
    brief = repr(sentinel[:60]) + ("..." if len(sentinel) > 60 else "")
    call = f"subprocess.Popen.__init__(<new subprocess.Popen>, ('touch', {brief}))"
    assert codes["CKF706"]["message"] == f"x: loading it would call {call}"
    assert codes["CKF704"]["fix"] == ("Do not load this file (with weights_only=False or with any allowlist): it runs "
                                      "code when loaded. Re-create the checkpoint from a source you trust.")
    assert "CKF705" not in codes and "add_safe_globals" not in res.stdout
    assert not Path(sentinel).exists()


def test_known_data_still_gets_its_allowlist_line(tmp_path):
    import pathlib

    torch.save({"model": {"w": torch.zeros(2)}, "args": argparse.Namespace(out=pathlib.PosixPath("/a"))},
               tmp_path / "ok.pth")
    res = cli("inspect", tmp_path / "ok.pth", "--json")
    fix = next(f for f in json.loads(res.stdout)["findings"] if f["code"] == "CKF704")["fix"]
    assert fix.endswith("or, if you trust the file: import torch; from argparse import Namespace; from pathlib "
                        "import PosixPath; torch.serialization.add_safe_globals([Namespace, PosixPath])"), fix


def test_a_user_class_is_never_named_in_an_allowlist_line(tmp_path):
    """ckptfix cannot check an unknown class's __new__/__setstate__ without importing it: convert is the fix."""
    script = ("import torch, sys\nclass Cfg:\n    pass\nc = Cfg(); c.lr = 0.1\n"
              "torch.save({'model': {'w': torch.zeros(2)}, 'cfg': c}, sys.argv[1])\n")
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "u.pth")], check=True, timeout=120)
    res = cli("inspect", tmp_path / "u.pth", "--json")
    finding = next(f for f in json.loads(res.stdout)["findings"] if f["code"] == "CKF704")
    assert finding["fix"] == (f"ckptfix convert {tmp_path / 'u.pth'} -o {tmp_path / 'u.weights_only.pth'} "
                              "(plain values, listed in the output's record)")
    assert "__main__.Cfg" in finding["pytorch"] and "these objects are data" not in finding["pytorch"]


def test_newobj_with_arguments_of_an_unknown_class_is_code(tmp_path):
    """`cls.__new__(cls, *args)` (NEWOBJ, protocol 2's copyreg.__newobj__): numpy.memmap's opens and truncates a
    file, shown live here; ckptfix refuses it instead of calling it a constructed object."""
    victim = tmp_path / "victim.bin"
    args = pickle.dumps((str(victim), "uint8", "w+", 0, (1,)), protocol=2)[2:-1]
    data = b"\x80\x02cnumpy\nmemmap\n" + args + b"\x81."  # GLOBAL numpy.memmap, the tuple, NEWOBJ, STOP
    (tmp_path / "m.pt").write_bytes(data)
    victim.write_bytes(b"precious")
    subprocess.run([sys.executable, "-c", "import pickle,sys; pickle.load(open(sys.argv[1],'rb'))",
                    str(tmp_path / "m.pt")], check=True, timeout=60)
    assert victim.read_bytes() == b"\x00"  # what loading it does
    victim.write_bytes(b"precious")
    res = cli("inspect", tmp_path / "m.pt")
    brief = repr(str(victim)[:60]) + ("..." if len(str(victim)) > 60 else "")
    assert res.returncode == 2 and res.stderr.strip() == (
        f"ckptfix: error: {tmp_path / 'm.pt'}: refusing to unpickle: it needs globals outside the safe allowlist "
        f"(numpy.memmap); loading it would call numpy.memmap.__new__({brief}, 'uint8', 'w+', 0, ...); loading it "
        "could execute code. Pass --trust-pickle only if you trust its author."), res.stderr
    assert victim.read_bytes() == b"precious"


# --- 2. in-place writes never go through planted links -----------------------------------------------

def _hf_sharded(tmp_path: Path) -> tuple[Path, Path]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    folder = tmp_path / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="8KB")
    return folder, train_bpe_tokenizer_json(tmp_path, 80, name="bpe80.json")


def _dcp_folder(tmp_path: Path) -> tuple[Path, Path]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = tmp_path / "step2"
    run = train(new_run(48), 2)
    msd, osd = get_state_dict(run.model, run.optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))
    return path, train_bpe_tokenizer_json(tmp_path, 64, name="bpe64.json")


PLANTED = {
    "hf": ["ckptfix.json.ckptfix-tmp", "ckptfix-restore.json.ckptfix-tmp", "model.safetensors.index.json.ckptfix-tmp",
           ".model.safetensors.index.json.ckptfix-tmp", "config.json.ckptfix-bak"],
    "dcp": ["ckptfix.json.ckptfix-tmp", "ckptfix-restore.json.ckptfix-tmp", ".metadata.ckptfix-bak",
            "..metadata.ckptfix-tmp", ".__ckptfix0_0.distcp.metadata"],
}


@pytest.mark.parametrize("kind", ["hf", "dcp"])
def test_in_place_never_writes_through_a_planted_link(tmp_path, kind):
    folder, tok = _hf_sharded(tmp_path) if kind == "hf" else _dcp_folder(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    for i, name in enumerate(PLANTED[kind]):
        victim = outside / f"victim{i}"
        victim.write_bytes(b"precious")
        (folder / name).symlink_to(victim)
    before_outside, before = snapshot(outside), snapshot(folder)
    res = cli("repair", folder, "-t", tok, "--in-place", "--keep-ids")
    assert snapshot(outside) == before_outside  # nothing written through any link
    if res.returncode == 2:  # a backup name it needs is taken: refused before anything changed
        assert snapshot(folder) == before
        assert res.stderr.startswith("ckptfix: error: ") and "already exists" in res.stderr, res.stderr
    else:
        assert res.returncode == 0, res.stderr
        for name in PLANTED[kind]:
            assert os.readlink(folder / name) == str(outside / f"victim{PLANTED[kind].index(name)}")
        assert cli("restore", folder).returncode == 0
        assert snapshot(outside) == before_outside


def test_an_existing_backup_name_is_refused_not_replaced(tmp_path):
    folder, tok = _dcp_folder(tmp_path)
    (folder / ".metadata.ckptfix-bak").write_bytes(b"mine")
    before = snapshot(folder)
    res = cli("repair", folder, "-t", tok, "--in-place", "--keep-ids")
    assert res.returncode == 2 and res.stderr.strip() == (
        f"ckptfix: error: {folder}: .metadata.ckptfix-bak already exists; move it away (an earlier backup?) and "
        "run again")
    assert snapshot(folder) == before


# --- 3. reads never leave an input folder through a link -------------------------------------------------

def test_an_index_shard_linking_out_is_not_read(tmp_path):
    folder, tok = _hf_sharded(tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index["model.embed_tokens.weight"]
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(folder / shard, outside / shard)
    (folder / shard).symlink_to(outside / shard)
    for args in (["inspect", folder], ["repair", folder, "-t", tok, "-o", tmp_path / "out", "--keep-ids"]):
        res = cli(*args)
        assert res.returncode == 2 and res.stderr.strip() == (
            f"ckptfix: error: {folder / shard}: leads out of the input folder {folder} (to {outside / shard}); "
            "ckptfix reads only what lives in the folder: copy the file in, or name its folder itself"), res.stderr
    assert not (tmp_path / "out").exists()


def test_a_folder_of_the_index_linking_out_is_not_read(tmp_path):
    folder, _ = _hf_sharded(tmp_path)
    real = tmp_path / "real"
    shutil.move(folder, real)
    outer = tmp_path / "outer"
    outer.mkdir()
    (outer / "weights").symlink_to(real)  # the folder named as input is itself a link: its target is the input
    assert cli("inspect", outer / "weights").returncode == 0


def test_a_dcp_data_file_linking_out_is_not_read(tmp_path):
    folder, tok = _dcp_folder(tmp_path)
    data = sorted(folder.glob("*.distcp"))[0]
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(data, outside / data.name)
    data.symlink_to(outside / data.name)
    res = cli("repair", folder, "-t", tok, "-o", tmp_path / "out")
    assert res.returncode == 2 and res.stderr.strip() == (
        f"ckptfix: error: {data}: leads out of the input folder {folder} (to {outside / data.name}); ckptfix reads "
        "only what lives in the folder: copy the file in, or name its folder itself"), res.stderr
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_folder_link_is_never_copied_into_out(tmp_path):
    from safetensors.torch import save_file

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"model.embed_tokens.weight": torch.randn(64, 8), "lm_head.weight": torch.randn(64, 8)},
              ckpt / "model.safetensors")
    (ckpt / "config.json").write_text(json.dumps({"vocab_size": 64, "model_type": "llama"}))
    tok = make_hf_tokenizer_folder(tmp_path, 80)
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET-KEY-1234")
    (tok / "merges.txt").symlink_to(secret)
    res = cli("repair", ckpt, "-t", tok, "-o", tmp_path / "out", "--keep-ids")
    assert res.returncode == 2 and res.stderr.strip() == (
        f"ckptfix: error: {tok / 'merges.txt'}: leads out of the input folder {tok} (to {secret}); ckptfix reads "
        "only what lives in the folder: copy the file in, or name its folder itself"), res.stderr
    assert not (tmp_path / "out").exists()
    assert not any(b"SECRET" in p.read_bytes() for p in tmp_path.rglob("*")
                   if p.is_file() and not p.is_symlink() and p != secret)


def test_hub_cache_snapshot_links_to_its_blobs_are_read(tmp_path):
    """A Hugging Face hub cache snapshot's files are links to ../../blobs/: inside the repository folder."""
    from safetensors.torch import save_file

    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    save_file({"w": torch.zeros(4, 2)}, blobs / "1111")
    (blobs / "2222").write_text(json.dumps({"model_type": "llama"}))
    (snap / "model.safetensors").symlink_to("../../blobs/1111")
    (snap / "config.json").symlink_to("../../blobs/2222")
    res = cli("inspect", snap)
    assert res.returncode == 0, res.stderr


# --- 4. restore reads its list like any input ------------------------------------------------------------

def _repaired_in_place(tmp_path: Path) -> Path:
    folder, tok = _dcp_folder(tmp_path)
    assert cli("repair", folder, "-t", tok, "--in-place", "--keep-ids").returncode == 0
    return folder


def _restore_line(folder: Path, rest: str) -> str:
    return f"ckptfix: error: {folder / 'ckptfix-restore.json'}: {rest}"


def test_restore_refuses_a_tampered_list(tmp_path):
    folder = _repaired_in_place(tmp_path)
    good = json.loads((folder / "ckptfix-restore.json").read_text())
    data_file = sorted(p.name for p in folder.glob("__*_0.distcp") if not p.name.startswith("__ckptfix"))[0]
    cases = {
        "not a dict": ([1, 2], "not a restore list (expected switch, backups and added); nothing restored"),
        "wrong types": ({**good, "added": "x"}, "not a restore list (expected switch, backups and added); "
                        "nothing restored"),
        "a path": ({**good, "added": ["../victim"]}, "added: '../victim' is not a file name in the folder; "
                   "nothing restored"),
        "a NUL": ({**good, "added": ["a\x00b"]}, "added: 'a\\x00b' is not a file name in the folder; "
                  "nothing restored"),
        "too long": ({**good, "added": ["a" * 300]}, None),
        "wrong backup": ({**good, "backups": {".metadata": "config.json"}},
                         "backups: .metadata -> config.json is not its .ckptfix-bak; nothing restored"),
        "a needed file": ({**good, "added": [*good["added"], data_file]},
                          f"would remove {data_file}, which the restored .metadata references; nothing restored"),
    }
    before = snapshot(folder)
    for name, (doc, message) in cases.items():
        (folder / "ckptfix-restore.json").write_text(json.dumps(doc))
        res = cli("restore", folder)
        assert res.returncode == 2 and res.stdout == "", (name, res)
        assert "\x1b" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, (name, res.stderr)
        if message is not None:
            assert res.stderr.strip() == _restore_line(folder, message), (name, res.stderr)
        now = snapshot(folder)
        now.pop("ckptfix-restore.json")
        assert now == {k: v for k, v in before.items() if k != "ckptfix-restore.json"}, name
    (folder / "ckptfix-restore.json").write_text(json.dumps(good))
    assert cli("restore", folder).returncode == 0


def test_restore_prints_names_escaped(tmp_path):
    folder = _repaired_in_place(tmp_path)
    doc = json.loads((folder / "ckptfix-restore.json").read_text())
    (folder / "\x1b[31mred\u202e").write_bytes(b"")
    doc["added"].append("\x1b[31mred\u202e")
    (folder / "ckptfix-restore.json").write_text(json.dumps(doc))
    res = cli("restore", folder)
    assert res.returncode == 0 and "removed \\x1b[31mred\\u202e" in res.stdout, res
    assert "\x1b" not in res.stdout and "\u202e" not in res.stdout


def test_restore_refuses_a_list_that_is_not_a_file(tmp_path):
    folder = _repaired_in_place(tmp_path)
    record = folder / "ckptfix-restore.json"
    record.unlink()
    os.mkfifo(record)
    res = cli("restore", folder)  # a FIFO: refused from stat, never opened (no hang)
    assert res.returncode == 2 and res.stderr.strip() == f"ckptfix: error: {record}: not a regular file (a FIFO)"
    record.unlink()
    record.symlink_to("/dev/zero")
    res = cli("restore", folder)
    assert res.returncode == 2 and res.stderr.strip() == _restore_line(
        folder, "a link, not the list an in-place repair writes; nothing restored")
    record.unlink()
    record.write_text("[" * 100_000)
    res = cli("restore", folder)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr


def test_an_optimizer_under_a_key_with_a_section_character_is_one_line(tmp_path):
    """Fuzz finding after the merges: sections are addressed as "key[i]"; an optimizer state under the key
    '\\x1b[31m' crashed the reader (KeyError, exit 3)."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    torch.save({"model": {"w": torch.zeros(2)}, "\x1b[31m": opt.state_dict()}, tmp_path / "k.pth")
    res = cli("inspect", tmp_path / "k.pth")
    assert (res.returncode, res.stderr.strip()) == (2, f"ckptfix: error: {tmp_path / 'k.pth'}: optimizer state under "
                                                       "the key '\\x1b[31m', whose '[' or '/' ckptfix cannot address; "
                                                       "rename the key")
