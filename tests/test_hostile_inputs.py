"""Hostile and broken inputs, one test per class of issue 19, each through the real CLI (`ckptfix.cli.main`
in a separate process, see `malicious_corpus.run_batch`) with the exact exit code and error line.

Inputs are built from real files: a checkpoint written by `torch.save` after real AdamW steps, a real
sentencepiece model, a real `dcp.save` folder; then one field is made wrong, a structure made deep or
shared, or the file swapped for a FIFO, device or link.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import re
import shutil
import warnings
import zipfile
from pathlib import Path

import malicious_corpus as mc
import pytest
import torch
from ckpt_factory import new_run, save_checkpoint, train
from tokenizer_factory import train_sentencepiece

ERR = "ckptfix: error: "
BOMB = "(a memo bomb: hashing it would hang or crash the unpickler); not a checkpoint"
DEEP_TUPLE = ("pickle holds a tuple nested more than 100 deep (real checkpoints nest a few; hashing one nested ~100k "
              "deep overflows the C stack); not a checkpoint")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    run = train(new_run(vocab=64), 3)
    good = save_checkpoint(run, root / "good.pth")
    tok = train_sentencepiece(root / "sp", 72)
    return {"root": root, "run": run, "good": good, "tok": tok}


def _variant(base, name: str, mutate) -> Path:
    run = base["run"]
    sd = {"model": run.model.state_dict(), "optimizer": copy.deepcopy(run.optimizer.state_dict()),
          "scheduler": run.scheduler.state_dict(), "scaler": run.scaler.state_dict(), "step": 3}
    mutate(sd)
    path = base["root"] / f"{name}.pth"
    torch.save(sd, path)
    return path


def _group(key, value):
    return lambda sd: sd["optimizer"]["param_groups"][0].__setitem__(key, value)


def _set(section, key, value):
    return lambda sd: sd[section].__setitem__(key, value)


def _tuple_keyed_state(sd):
    state = sd["optimizer"]["state"]
    state[(0, 1)] = state.pop(0)


def _dag_record(sd):
    x: list = [1]
    for _ in range(40):
        x = [x, x]
    sd["ckptfix"] = {"schema": "ckptfix.repair/1", "notes": x}


WRONG_TYPES = {  # name: (mutation, message after "<path>: ")
    "weight_decay_list": (_group("weight_decay", [1, 2]), "optimizer: param_groups[0].weight_decay: expected a number, got a list"),
    "weight_decay_str": (_group("weight_decay", "x"), "optimizer: param_groups[0].weight_decay: expected a number, got the string 'x'"),
    "betas_int": (_group("betas", 3), "optimizer: param_groups[0].betas: expected a short list of numbers, got 3"),
    "betas_none": (_group("betas", None), "optimizer: param_groups[0].betas: expected a short list of numbers, got None"),
    "lr_bool": (_group("lr", True), "optimizer: param_groups[0].lr: expected a number, got True"),
    "scaler_int_keys": (lambda sd: sd.__setitem__("scaler", {1: 2.0}), "scaler: scaler key: expected string attribute names, got 1"),
    "scaler_scale_str": (_set("scaler", "scale", "big"), "scaler: scale: expected a number, got the string 'big'"),
    "last_epoch_str": (_set("scheduler", "last_epoch", "x"), "scheduler: last_epoch: expected an integer in "
                       "[-9223372036854775808, 9223372036854775807], got the string 'x'"),
    "last_lr_dict": (_set("scheduler", "_last_lr", {"a": 1}), "scheduler: _last_lr: expected a list of learning rates, got a dict"),
    "tuple_keyed_moments": (_tuple_keyed_state, "optimizer: state key: expected a parameter index (int) or name (str), got a tuple"),
    "dag_record": (_dag_record, "ckptfix record: expected a tree (no shared or cyclic sub-objects), got a list"),
}


@pytest.fixture(scope="module")
def results(base):
    """Every CLI job of this module, run in one batch process (an in-process alarm catches hangs)."""
    jobs = {}
    for name, (mutate, _) in WRONG_TYPES.items():
        path = _variant(base, name, mutate)
        jobs[name] = ["inspect", str(path), "--json"]
    jobs.update(_file_jobs(base))
    out = mc.run_batch([{"id": k, "argv": v} for k, v in jobs.items()], cwd=base["root"], timeout=20)
    return out


@pytest.mark.parametrize("name", list(WRONG_TYPES))
def test_wrong_typed_values_are_one_line_exit_2(base, results, name):
    r = results[name]
    expected = f"{ERR}{base['root'] / name}.pth: {WRONG_TYPES[name][1]}"
    assert (r["code"], r["stderr"].strip()) == (2, expected)


def _file_jobs(base) -> dict[str, list[str]]:
    root, good, tok = base["root"], str(base["good"]), str(base["tok"])
    os.mkfifo(root / "fifo")
    (root / "a_file").write_text("x")
    nested = root / "anc" / "in"
    nested.mkdir(parents=True)
    shutil.copy(good, nested / "c.pth")
    (root / "side.pth.ckptfix.json").write_text("{}")
    torch.save(base["run"].model.state_dict(), root / "bare.pth")
    (root / "digits.json").write_text('{"model": {"type": "BPE", "vocab": {"a": ' + "9" * 5000 + '}}}')
    with open(root / "sparse.json", "wb") as f:
        f.truncate(6 << 30)
    repair = ["repair", good, "--tokenizer", tok, "-o"]
    return {
        "ckpt_fifo": ["inspect", str(root / "fifo")],
        "ckpt_device": ["inspect", "/dev/zero"],
        "tok_fifo": ["inspect", good, "--tokenizer", str(root / "fifo")],
        "tok_urandom": ["inspect", good, "--tokenizer", "/dev/urandom"],
        "from_tok_fifo": ["repair", good, "--tokenizer", tok, "--from-tokenizer", str(root / "fifo"),
                          "-o", str(root / "o1.pth")],
        "tok_5000_digits": ["inspect", good, "--tokenizer", str(root / "digits.json")],
        "tok_sparse_6gb": ["inspect", good, "--tokenizer", str(root / "sparse.json")],
        "out_missing_parent": repair + [str(root / "nope" / "x.pth")],
        "out_under_a_file": repair + [str(root / "a_file" / "x.pth")],
        "out_in_proc": repair + ["/proc/x.pth"],
        "out_250_chars": repair + [str(root / ("a" * 250 + ".pth"))],
        "out_ancestor_force": ["repair", str(nested / "c.pth"), "--tokenizer", tok, "-o", str(root / "anc"), "--force"],
        "out_ancestor": ["repair", str(nested / "c.pth"), "--tokenizer", tok, "-o", str(root / "anc")],
        "out_inside_input_folder": ["repair", str(root / "anc"), "--tokenizer", tok, "-o", str(nested / "x")],
        "sidecar_exists": ["repair", str(root / "bare.pth"), "--tokenizer", tok, "-o", str(root / "side.pth")],
    }


FILE_CASES = {  # name: regex of the one error line (after "ckptfix: error: "); ROOT is the test's folder
    "ckpt_fifo": r"ROOT/fifo: not a regular file or folder \(a FIFO\)",
    "ckpt_device": r"/dev/zero: not a regular file or folder \(a device\)",
    "tok_fifo": r"ROOT/fifo: not a regular file \(a FIFO\)",
    "tok_urandom": r"/dev/urandom: not a regular file \(a device\)",
    "from_tok_fifo": r"ROOT/fifo: not a regular file \(a FIFO\)",
    "tok_5000_digits": r"ROOT/digits.json: invalid JSON \(an integer of 5000 digits\)",
    "tok_sparse_6gb": r"ROOT/sparse.json: tokenizer file of 6,442,450,944 bytes is larger than ckptfix reads "
                      r"\(256 MiB\); not a real tokenizer file\?",
    "out_missing_parent": r"ROOT/nope/x.pth: the output's folder ROOT/nope does not exist; create it first",
    "out_under_a_file": r"ROOT/a_file/x.pth: the output's folder ROOT/a_file is not a folder; create it first",
    "out_in_proc": r"/proc/x.pth: (write failed \(.*\); nothing was written|cannot write in /proc \(permission denied\))",
    "out_250_chars": r"ROOT/a{250}.pth: name too long \(254 bytes; at most 229 leave room for the temporary file beside it\)",
    "out_ancestor_force": r"ROOT/anc: a folder that contains the input ROOT/anc/in/c.pth; replacing it would delete "
                          r"the input \(--force does not allow that\)",
    "out_ancestor": r"ROOT/anc: a folder that contains the input ROOT/anc/in/c.pth; replacing it would delete "
                    r"the input \(--force does not allow that\)",
    "out_inside_input_folder": r"ROOT/anc/in/x: inside the input folder ROOT/anc; write the repair elsewhere",
    "sidecar_exists": r"ROOT/side.pth.ckptfix.json: already exists \(the record of a previous repair\?\); "
                      r"pass --force to replace it with OUT",
}


@pytest.mark.parametrize("name", list(FILE_CASES))
def test_file_rules(base, results, name):
    r = results[name]
    assert r["code"] == 2, r
    lines = r["stderr"].strip().splitlines()
    expected = re.escape(ERR) + FILE_CASES[name].replace("ROOT", re.escape(str(base["root"])))
    assert len(lines) == 1 and re.fullmatch(expected, lines[0]), lines


def test_nothing_written_but_out(base, results):
    """None of the refused repairs above left a file: the input folder holds what the test made."""
    root = base["root"]
    assert sorted(os.listdir(root / "anc")) == ["in"] and sorted(os.listdir(root / "anc" / "in")) == ["c.pth"]
    assert (root / "side.pth.ckptfix.json").read_text() == "{}" and not (root / "side.pth").exists()
    assert not [p for p in os.listdir(root) if p.startswith(".") or p.endswith(".pth") and p.startswith(("o1", "x"))]


def test_escape_sequences_in_names_never_reach_the_terminal(base, tmp_path):
    """A tensor name and a key with terminal control characters: escaped in the report and the error line."""
    torch.save({"model": {**base["run"].model.state_dict(), "emb\x1b[2J\x1b]0;owned\x07.weight": torch.zeros(4, 2)}},
               tmp_path / "esc.pth")
    torch.save({"\x1b[31mkey": 1}, tmp_path / "esc_err.pth")
    out = mc.run_batch([{"id": "report", "argv": ["diff", str(base["good"]), str(tmp_path / "esc.pth")]},
                        {"id": "error", "argv": ["inspect", str(tmp_path / "esc_err.pth")]}], cwd=tmp_path)
    assert out["report"]["code"] in (0, 1) and "emb\\x1b[2J\\x1b]0;owned\\x07.weight" in out["report"]["stdout"], out
    assert out["error"]["code"] == 2 and "\\x1b[31mkey" in out["error"]["stderr"]
    for r in out.values():
        assert "\x1b" not in r["stdout"] + r["stderr"] and "\x07" not in r["stdout"] + r["stderr"]


# --- folders: links out of the input, non-regular entries --------------------------------------------

@pytest.fixture(scope="module")
def hf_folder(base, tmp_path_factory):
    """A real HF Trainer-style folder: model.safetensors from save_pretrained-like code, optimizer.pt."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("hf_links")
    folder = root / "checkpoint-3"
    folder.mkdir()
    run = base["run"]
    save_file({k: v.contiguous() for k, v in run.model.state_dict().items()}, folder / "model.safetensors")
    torch.save(run.optimizer.state_dict(), folder / "optimizer.pt")
    torch.save(run.scheduler.state_dict(), folder / "scheduler.pt")
    (folder / "trainer_state.json").write_text('{"global_step": 3}')
    return folder


def test_links_out_of_the_input_folder_are_never_followed(base, hf_folder, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("do not copy me")
    src = tmp_path / "src"
    shutil.copytree(hf_folder, src)
    os.symlink(secret, src / "notes.txt")
    os.symlink("/dev/zero", src / "zeros.bin")
    os.symlink("trainer_state.json", src / "state_link.json")
    (src / "sub").mkdir()
    os.symlink(tmp_path, src / "sub" / "outside_dir")
    out = tmp_path / "fixed"
    r = mc.run_batch([{"id": 0, "argv": ["repair", str(src), "--tokenizer", str(base["tok"]), "-o", str(out)]}],
                     cwd=tmp_path)[0]
    assert r["code"] == 0, r
    assert os.readlink(out / "notes.txt") == str(secret) and os.readlink(out / "zeros.bin") == "/dev/zero"
    assert os.readlink(out / "state_link.json") == "trainer_state.json"  # inside: kept as it was
    assert os.readlink(out / "sub" / "outside_dir") == str(tmp_path)
    assert not any(p.is_file() and not p.is_symlink() and p.read_bytes() == b"do not copy me" for p in out.rglob("*"))


def test_fifo_in_input_folder_is_refused(base, hf_folder, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(hf_folder, src)
    os.mkfifo(src / "rng_state.fifo")
    r = mc.run_batch([{"id": 0, "argv": ["repair", str(src), "--tokenizer", str(base["tok"]), "-o",
                                         str(tmp_path / "fixed")]}], cwd=tmp_path, timeout=20)[0]
    assert r["code"] == 2 and r["stderr"].strip() == (
        f"{ERR}{src}/rng_state.fifo: a named pipe, not a regular file; a folder copy takes no FIFOs, devices or sockets")
    assert sorted(os.listdir(tmp_path)) == ["src"]


# --- DAGs and deep nesting -------------------------------------------------------------------------

def _pickle_bytes(obj) -> bytes:
    return pickle.dumps(obj, protocol=2)


def test_dag_in_extras_renders_fast_as_text_and_json(tmp_path):
    """Memo-shared lists (2**40 paths) in an extra key: the report and --json stay linear."""
    x: list = [1]
    for _ in range(40):
        x = [x, x]
    torch.save({"model": {"w": torch.zeros(2)}, "extra": x, "more": {"a": x, "b": [x] * 50}}, tmp_path / "dag.pth")
    out = mc.run_batch([{"id": f, "argv": ["inspect", str(tmp_path / "dag.pth"), *f.split()]}
                        for f in ("", "--json")], cwd=tmp_path, timeout=10)
    assert out[""]["code"] == 0 and out["--json"]["code"] == 0, out


def test_deep_nesting_never_overflows_the_stack(tmp_path):
    """A torch.save zip whose `extra` value is a list or a dict nested 200k deep (ops as protocol 2 writes
    them; `torch.load(weights_only=True)` reads both) is inspected, as text and --json, and compared by
    diff without a signal; a tuple nested 300k deep is refused before unpickling with the exact line."""
    deep = {"list": b"](" * 200_000 + mc._i(1) + b"e" * 200_000,
            "dict": b"}(" + (mc._s("k") + b"}(") * 200_000 + mc._s("k") + mc._i(1) + b"u" * 200_001,
            "tuple": mc._i(1) + b"\x85" * 300_000}
    jobs = []
    for name, ops in deep.items():
        pkl = mc._pickle(mc._dict(mc._s("model"), mc._dict(mc._s("w"), mc._tensor("0", 4)), mc._s("extra"), ops))
        mc.torch_zip(tmp_path / f"{name}.pth", pkl, {"0": bytes(16)})
        jobs += [{"id": f"{name}{f}", "argv": ["inspect", str(tmp_path / f"{name}.pth"), *f.split()]}
                 for f in ("", " --json", " --trust-pickle --json")]
        jobs.append({"id": f"{name} diff", "argv": ["diff", str(tmp_path / f"{name}.pth"), str(tmp_path / f"{name}.pth")]})
    out = mc.run_batch(jobs, cwd=tmp_path, timeout=20)
    for name in ("list", "dict"):
        assert torch.load(tmp_path / f"{name}.pth", weights_only=True)["model"]["w"].shape == (4,)
        assert (out[name]["code"], out[name]["stderr"]) == (0, ""), out[name]
        assert "model      1 tensors, 4 values, 16 B (float32 x1)" in out[name]["stdout"], out[name]
        for flags in (" --json", " --trust-pickle --json"):
            r = out[name + flags]
            assert (r["code"], r["stderr"]) == (0, ""), r
            extra = json.loads(r["stdout"])["extras"]["extra"]
            assert extra == ([[[["<list>"]]]] if name == "list" else {"k": {"k": {"k": {"k": "<dict>"}}}}), extra
        assert out[f"{name} diff"]["code"] == 1 and "0 changed, 1 unchanged" in out[f"{name} diff"]["stdout"]
    for job in ("tuple", "tuple --json", "tuple --trust-pickle --json", "tuple diff"):
        assert (out[job]["code"], out[job]["stderr"].strip()) == (2, f"{ERR}{tmp_path / 'tuple.pth'}: {DEEP_TUPLE}"), out[job]


def test_many_distinct_steps(base, tmp_path):
    """150k optimizer entries, each with its own `step`: inspect answers (the run's timeout is a hang guard; its
    time against the number of entries is bench/many_steps.py's)."""
    run = base["run"]
    osd = copy.deepcopy(run.optimizer.state_dict())
    osd["state"] = {i: {"step": float(i)} for i in range(150_000)}
    osd["param_groups"][0]["params"] = list(range(150_000))
    torch.save({"model": run.model.state_dict(), "optimizer": osd}, tmp_path / "steps.pth")
    r = mc.run_batch([{"id": 0, "argv": ["inspect", str(tmp_path / "steps.pth")]}], cwd=tmp_path, timeout=60)[0]
    assert r["code"] in (0, 1) and "Traceback" not in r["stderr"], r


def test_dcp_metadata_deeply_nested_planner_path(tmp_path):
    """A real dcp.save folder whose .metadata names a 100k-deep state-dict path."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.zeros(3)}, "step": 1}, checkpoint_id=str(tmp_path / "dcp"))
    meta = tmp_path / "dcp" / ".metadata"
    md = pickle.loads(meta.read_bytes())
    md.planner_data = {k: tuple(["model"] * 100_000) for k in md.planner_data}
    meta.write_bytes(pickle.dumps(md))
    r = mc.run_batch([{"id": 0, "argv": ["inspect", str(tmp_path / "dcp")]}], cwd=tmp_path, timeout=10)[0]
    assert (r["code"], r["stderr"].strip()) == (
        2, f"{ERR}{meta}: planner_data['model.w']: expected a list of at most 64 items, got a tuple"), r


# --- views whose element count is not backed by bytes ----------------------------------------------

def test_a_view_past_its_storage_is_refused_before_any_plan(base, tmp_path):
    """A real checkpoint whose last (64, D) tensor, the head's exp_avg_sq, claims 2**31-1 rows over its
    storage of 64 rows (the fuzzer's pickle mutator found it: repair sized a row plan from the shape and
    took 21 GB before the OOM killer). torch.load refuses the file; inspect and repair exit 2 with one line."""
    members = mc.zip_members(base["good"])
    name, pkl = next((n, b) for n, b in members if n.endswith("/data.pkl"))
    at = max(m.start() for m in re.finditer(rb"K@K.\x86", pkl, re.S))  # the last (64, D) size tuple
    dim = pkl[at + 3]
    patched = pkl[:at] + b"J\xff\xff\xff\x7f" + pkl[at + 2:]
    path = mc.write_zip(tmp_path / "past.pth", [(n, patched if n == name else b) for n, b in members])
    with pytest.raises(RuntimeError):
        torch.load(path, weights_only=True)
    line = (f"{ERR}{path}: corrupt pickle (tensor of shape [2147483647, {dim}] (offset 0, strides [{dim}, 1]) "
            f"reaches past its storage of {64 * dim * 4:,} bytes; torch.load refuses it too)")
    out = mc.run_batch([{"id": "inspect", "argv": ["inspect", str(path)]},
                        {"id": "repair", "argv": ["repair", str(path), "--tokenizer", str(base["tok"]), "-o",
                                                  str(tmp_path / "fixed.pth"), "--init", "zeros"]}], cwd=tmp_path)
    for r in out.values():
        assert (r["code"], r["stderr"].strip()) == (2, line), r
    assert sorted(os.listdir(tmp_path)) == ["past.pth"]


def test_stride_0_views_are_never_materialised(base, tmp_path):
    """A 4M x 64 embedding that is one 64-value row expanded (16 KB of bytes, 1 GB if materialised):
    --scan counts its NaN exactly (times the repeats), diff compares it, repair refuses to resize it."""
    row = torch.zeros(64)
    row[3] = float("nan")
    big = {"model.embed_tokens.weight": row.as_strided((4_000_000, 64), (0, 1)), "x": torch.zeros(2)}
    torch.save({"model": big}, tmp_path / "s0.pth")
    out = mc.run_batch([
        {"id": "scan", "argv": ["inspect", str(tmp_path / "s0.pth"), "--scan", "--json"]},
        {"id": "diff", "argv": ["diff", str(tmp_path / "s0.pth"), str(tmp_path / "s0.pth"), "--json"]},
        {"id": "repair", "argv": ["repair", str(tmp_path / "s0.pth"), "-t", str(base["tok"]), "-o",
                                  str(tmp_path / "out.pth")]},
    ], cwd=tmp_path, timeout=15)
    import json

    scan = json.loads(out["scan"]["stdout"])
    assert out["scan"]["code"] == 1 and "model.embed_tokens.weight (4000000)" in json.dumps(scan["findings"])
    assert out["diff"]["code"] == 1 and json.loads(out["diff"]["stdout"])["summary"]["unchanged"] == 2
    assert (out["repair"]["code"], out["repair"]["stderr"].strip()) == (2, (
        f"{ERR}{tmp_path / 's0.pth'}: model.embed_tokens.weight is a view that repeats its storage (strides "
        "[0, 1], e.g. from expand()); save it with .contiguous() before repairing it"))
    assert sorted(os.listdir(tmp_path)) == ["s0.pth"]


# --- pickles that flood memory ---------------------------------------------------------------------

def test_pickle_floods_are_refused_before_they_cost_memory(base, tmp_path):
    """A data.pkl deflated 1000x (a list of 60M empty dicts in 61 KB), and a stored 3 MB pickle of
    EMPTY_SETs (each 1 byte -> 216 bytes): refused, not gigabytes."""
    with zipfile.ZipFile(base["good"]) as zf:
        members = [(i.filename, zf.read(i)) for i in zf.infolist()]
    flood = b"\x80\x02](" + b"}" * (60 << 20) + b"e."
    sets = b"\x80\x02](" + b"\x8f" * (3 << 20) + b"e."
    for name, pkl, method in (("deflated", flood, zipfile.ZIP_DEFLATED), ("sets", sets, zipfile.ZIP_STORED)):
        with zipfile.ZipFile(tmp_path / f"{name}.pth", "w") as zf:
            for member, body in members:
                zf.writestr(zipfile.ZipInfo(member), pkl if member.endswith("data.pkl") else body, compress_type=method)
    out = mc.run_batch([{"id": n, "argv": ["inspect", str(tmp_path / f"{n}.pth")]} for n in ("deflated", "sets")],
                       cwd=tmp_path, timeout=15)
    assert (out["deflated"]["code"], out["deflated"]["stderr"].strip()) == (2, (
        f"{ERR}{tmp_path / 'deflated.pth'}: data.pkl inflates "
        f"{zipfile.ZipFile(tmp_path / 'deflated.pth').getinfo('good/data.pkl').compress_size:,} bytes to "
        "62,914,566; refusing to inflate it (a zip bomb?)"))
    assert (out["sets"]["code"], out["sets"]["stderr"].strip()) == (2, (
        f"{ERR}{tmp_path / 'sets.pth'}: pickle builds more than 917,504 containers and objects from 3,145,734 "
        "bytes (a flood: real checkpoints build about one per 25 bytes); not a checkpoint"))


def _claim_zip64_size(src: Path, dst: Path, suffix: bytes, claim: int) -> None:
    """Rewrite the central directory so that member `suffix` claims `claim` bytes through a zip64 extra field."""
    import struct

    data = src.read_bytes()
    eocd = data.rfind(b"PK\x05\x06")
    cd_size, cd_off = struct.unpack_from("<II", data, eocd + 12)
    cd, out, i = data[cd_off:cd_off + cd_size], bytearray(), 0
    while i < len(cd):
        fixed = bytearray(cd[i:i + 46])
        nlen, elen, clen = struct.unpack_from("<HHH", fixed, 28)
        name, extra = cd[i + 46:i + 46 + nlen], cd[i + 46 + nlen:i + 46 + nlen + elen]
        comment = cd[i + 46 + nlen + elen:i + 46 + nlen + elen + clen]
        if name.endswith(suffix):
            struct.pack_into("<II", fixed, 20, 0xFFFFFFFF, 0xFFFFFFFF)
            extra = struct.pack("<HHQQ", 1, 16, claim, claim) + extra
            struct.pack_into("<H", fixed, 30, len(extra))
        out += fixed + name + extra + comment
        i += 46 + nlen + elen + clen
    tail = bytearray(data[eocd:])
    struct.pack_into("<I", tail, 12, len(out))
    dst.write_bytes(data[:cd_off] + bytes(out) + bytes(tail))


def test_zip64_member_claiming_4_eib_under_verify(base, tmp_path):
    """A tensor record whose zip64 size says 4 EiB: --verify and --scan report it at once, no CRC loop."""
    _claim_zip64_size(base["good"], tmp_path / "z64.pth", b"data/0", 1 << 62)
    out = mc.run_batch([{"id": f, "argv": ["inspect", str(tmp_path / "z64.pth"), *f.split(), "--json"]}
                        for f in ("--verify", "--scan --verify")], cwd=tmp_path, timeout=15)
    for r in out.values():
        assert r["code"] in (1, 2) and "Traceback" not in r["stderr"], r
        if r["code"] == 1:
            import json

            assert "CKF703" in {f["code"] for f in json.loads(r["stdout"])["findings"]}, r


def test_from_tokenizer_with_wrong_typed_merges_is_exit_2(base, tmp_path):
    """Found by the fuzzer: --from-tokenizer whose BPE merges hold a list where a pair of strings belongs
    (the pieces initialiser hands the file to `tokenizers`, which refuses it; the vocabulary reader does not
    read merges): one line naming the file and the library's words, exit 2."""
    import json

    from tokenizer_factory import train_tokenizer_json

    doc = json.loads(train_tokenizer_json(tmp_path / "t", 60).read_text())
    doc["model"]["merges"][0] = [[1], 2]
    (tmp_path / "tokenizer.json").write_text(json.dumps(doc))
    r = mc.run_batch([{"id": 0, "argv": ["repair", str(base["good"]), "--tokenizer", str(base["tok"]),
                                         "--from-tokenizer", str(tmp_path / "tokenizer.json"), "--dry-run"]}],
                     cwd=tmp_path)[0]
    assert (r["code"], r["stderr"].strip()) == (2, (
        f"{ERR}{tmp_path / 'tokenizer.json'}: its tokenizer library cannot load it for --init pieces: data did not "
        "match any variant of untagged enum MergeType at line 1 column 1595"))


def test_non_finite_optimizer_options_render_as_text(base):
    """A real AdamW state dict whose weight_decay is NaN or inf (the fuzzer's tree mutator found the text
    report's `:g` format applied to the "nan" that --json carries: exit 3): both reports show it, exit 0."""
    jobs = []
    for name, value in {"wd_nan": float("nan"), "wd_inf": float("inf")}.items():
        path = _variant(base, name, _group("weight_decay", value))
        jobs += [{"id": name, "argv": ["inspect", str(path)]}, {"id": name + "-json", "argv": ["inspect", str(path), "--json"]}]
    out = mc.run_batch(jobs, cwd=base["root"], timeout=20)
    assert [out[k]["code"] for k in ("wd_nan", "wd_nan-json", "wd_inf", "wd_inf-json")] == [0, 0, 0, 0], out
    assert "wd nan]" in out["wd_nan"]["stdout"] and "wd inf]" in out["wd_inf"]["stdout"]


def _python_peak(argv: list[str]) -> tuple[int, int]:
    """(exit code, peak Python allocation in bytes) of one in-process CLI run."""
    import contextlib
    import io
    import tracemalloc

    from ckptfix.cli import main

    tracemalloc.start()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                main(argv)
                code = 0
            except SystemExit as exc:
                code = exc.code
        return code, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_small_files_are_never_read_with_the_cap_as_buffer(base, tmp_path):
    """`f.read(cap)` allocates the cap before reading: a 13 KB DCP `.metadata` cost a 64 MiB buffer and a
    sentencepiece model compared for user-defined pieces a 256 MiB one (the fuzzer's tracemalloc peaks).
    A real dcp.save folder and the real tokenizer: both read with buffers the size of the file."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": base["run"].model.state_dict(), "step": 3}, checkpoint_id=str(tmp_path / "dcp"))
    code, peak = _python_peak(["inspect", str(tmp_path / "dcp")])
    assert code == 0 and peak < 16 << 20, (code, peak >> 20)
    code, peak = _python_peak(["inspect", str(base["good"]), "--tokenizer", str(base["tok"])])
    assert code in (0, 1) and peak < 16 << 20, (code, peak >> 20)


def test_dcp_metadata_30000_dimension_size(tmp_path):
    """A real dcp.save folder whose .metadata gives a tensor 30000 dimensions: the exact line, exit 2."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.zeros(3)}, "step": 1}, checkpoint_id=str(tmp_path / "dcp"))
    meta = tmp_path / "dcp" / ".metadata"
    md = pickle.loads(meta.read_bytes())
    object.__setattr__(md.state_dict_metadata["model.w"], "size", [1] * 30_000)
    meta.write_bytes(pickle.dumps(md))
    r = mc.run_batch([{"id": 0, "argv": ["inspect", str(tmp_path / "dcp")]}], cwd=tmp_path, timeout=10)[0]
    assert (r["code"], r["stderr"].strip()) == (
        2, f"{ERR}{meta}: 'model.w' size: expected a shape of at most 64 dimensions, got 30,000"), r


def test_legacy_pth_is_mapped_not_read_whole(tmp_path):
    """A pre-1.6 torch.save stream (`_use_new_zipfile_serialization=False`): its storages follow the
    pickles; inspect copies out the pickles only (a 64 MiB tensor took a 66 MiB peak when the file was
    read whole; 3 MiB mapped)."""
    path = tmp_path / "legacy.pth"
    torch.save({"w": torch.zeros(16 << 20), "step": 3}, path, _use_new_zipfile_serialization=False)
    code, peak = _python_peak(["inspect", str(path)])
    assert code == 0 and peak < 16 << 20, (code, peak >> 20)




def test_memo_dag_and_deep_tuples_are_one_exact_line(tmp_path):
    """A tuple DAG 60 levels deep as a dict key (2**60 hashing steps), a tuple nested 300k deep as a key
    (a C-stack overflow when hashed) and as a value: exit 2 with the exact line, before any unpickling."""
    cases = {
        "dag_key": (mc.tuple_dag_key_pickle(60), f"pickle holds a tuple nested 19 deep that expands to 1,048,575 nodes {BOMB}"),
        "deep_key": (mc.deep_tuple_key_pickle(300_000), DEEP_TUPLE),
        "deep_value": (b"\x80\x02}X\x05\x00\x00\x00model}X\x01\x00\x00\x00xK\x01" + b"\x85" * 300_000 + b"ss.",
                       DEEP_TUPLE),
    }
    for name, (data, _) in cases.items():
        (tmp_path / f"{name}.pth").write_bytes(data)
    out = mc.run_batch([{"id": n, "argv": ["inspect", str(tmp_path / f"{n}.pth")]} for n in cases], cwd=tmp_path, timeout=20)
    for name, (_, line) in cases.items():
        assert (out[name]["code"], out[name]["stderr"].strip()) == (2, f"{ERR}{tmp_path / name}.pth: {line}"), out[name]


def test_repair_of_a_deeply_nested_optimizer_value_is_one_line(base, hf_folder, tmp_path):
    """A real HF Trainer folder whose optimizer.pt (torch.save) holds a list nested 400 deep in a moment's
    place: torch.load reads it, ckptfix's writer cannot write it (the fuzzer's hf mutator found a
    RecursionError, exit 3): exit 2, one line, nothing written."""
    src = tmp_path / "src"
    shutil.copytree(hf_folder, src)
    osd = torch.load(src / "optimizer.pt", weights_only=True)
    deep: list = [1]
    for _ in range(400):
        deep = [deep]
    next(iter(osd["state"].values()))["extra"] = deep
    torch.save(osd, src / "optimizer.pt")
    r = mc.run_batch([{"id": 0, "argv": ["repair", str(src), "--tokenizer", str(base["tok"]), "-o",
                                         str(tmp_path / "fixed"), "--init", "zeros"]}], cwd=tmp_path, timeout=20)[0]
    # the audit (issue 27) refuses it first, before the writer would: what lies past its depth bound is unchecked
    err = r["stderr"].strip()
    assert r["code"] == 2 and "\n" not in err and err.startswith(ERR), r
    assert err.endswith("the tree is past the audit's bound (32 levels, 1000000 values): what lies beyond was not "
                        "checked; resolve: none: ckptfix cannot vouch for this checkpoint") or err == (
        f"{ERR}cannot write this checkpoint: a value in it is nested more than a few hundred levels deep (real "
        "checkpoints nest a few); nothing was written"), r
    assert sorted(os.listdir(tmp_path)) == ["src"]


def _patch_central_directory(data: bytes, suffix: bytes, patch) -> bytes:
    """`data` (a zip) with `patch(fixed_46_byte_header)` applied to member `suffix`'s central directory entry."""
    import struct

    eocd = data.rfind(b"PK\x05\x06")
    cd_size, cd_off = struct.unpack_from("<II", data, eocd + 12)
    out, i = bytearray(data), cd_off
    while i < cd_off + cd_size:
        nlen, elen, clen = struct.unpack_from("<HHH", out, i + 28)
        if bytes(out[i + 46:i + 46 + nlen]).endswith(suffix):
            patch(out, i)
        i += 46 + nlen + elen + clen
    return bytes(out)


def test_stored_member_with_a_lying_compressed_size(base, tmp_path):
    """Found by the fuzzer: a stored data.pkl whose central directory claims 2.9 GB of compressed bytes
    made zipfile read(2.9 GB) (a 1 GiB Python buffer before a byte was read). Exact line, exit 2."""
    import struct

    data = _patch_central_directory(base["good"].read_bytes(), b"data.pkl",
                                    lambda b, i: struct.pack_into("<I", b, i + 20, 2_896_542_633))
    path = tmp_path / "lying.pth"
    path.write_bytes(data)
    pkl = zipfile.ZipFile(base["good"]).getinfo(next(n for n in zipfile.ZipFile(base["good"]).namelist()
                                                     if n.endswith("data.pkl")))
    code, peak = _python_peak(["inspect", str(path)])
    assert code == 2 and peak < 16 << 20, (code, peak >> 20)
    r = mc.run_batch([{"id": 0, "argv": ["inspect", str(path)]}], cwd=tmp_path)[0]
    assert (r["code"], r["stderr"].strip()) == (2, (
        f"{ERR}{path}: data.pkl declares 2,896,542,633 stored bytes for {pkl.file_size:,} "
        f"(a file of {len(data):,}); corrupt zip directory"))


def test_dcp_record_with_an_unknown_zip_version(tmp_path):
    """Found by the fuzzer: a real dcp.save folder whose item zip (inside the .distcp) names an extract
    version zipfile does not implement ('zip file version 25.5', NotImplementedError: exit 3 before)."""
    import struct

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.zeros(3)}, "step": 1}, checkpoint_id=str(tmp_path / "dcp"))
    shard = next((tmp_path / "dcp").glob("*.distcp"))
    # every central directory entry in the file (one zip per item): version needed to extract = 25.5
    data, i = bytearray(shard.read_bytes()), 0
    while (i := data.find(b"PK\x01\x02", i)) >= 0:
        struct.pack_into("<H", data, i + 6, 255)
        i += 4
    shard.write_bytes(bytes(data))
    r = mc.run_batch([{"id": 0, "argv": ["inspect", str(tmp_path / "dcp"), "--verify"]}], cwd=tmp_path)[0]
    assert r["code"] == 2 and r["stderr"].count("\n") == 1, r
    assert r["stderr"].startswith(f"{ERR}{shard}: record of ") and "(zip file version 25.5)" in r["stderr"], r
