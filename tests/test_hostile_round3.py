"""Hostile inputs, round 3 (issue 28, items 5 and 6): each class through the real CLI in a separate process
(`malicious_corpus.run_batch`) with the exact exit code and error line.

Carriers are real files (a `torch.save` checkpoint after real AdamW steps, a real `dcp.save` folder, a real
sentencepiece model, files written by the safetensors library); one field is then made hostile.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import time
import warnings
import zipfile
from pathlib import Path

import malicious_corpus as mc
import pytest
import torch
from ckpt_factory import new_run, save_checkpoint, train
from test_hostile_inputs import _python_peak
from tokenizer_factory import train_sentencepiece

ERR = "ckptfix: error: "
DEEP_TUPLE = ("pickle holds a tuple nested more than 100 deep (real checkpoints nest a few; hashing one nested ~100k "
              "deep overflows the C stack); not a checkpoint")
G = mc._g


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("round3")
    run = train(new_run(vocab=64), 3)
    good = save_checkpoint(run, root / "good.pth")
    tok = train_sentencepiece(root / "sp", 72)
    return {"root": root, "run": run, "good": good, "tok": tok}


def _run(jobs: dict[str, list[str]], cwd: Path, timeout: float = 30) -> dict:
    return mc.run_batch([{"id": k, "argv": v} for k, v in jobs.items()], cwd=cwd, timeout=timeout)


def _zip_with_extra(path: Path, extra_ops: bytes, key: str = "extra") -> Path:
    """A torch.save-style zip: {"model": {"w": tensor(4)}, key: <extra_ops>}."""
    pkl = mc._pickle(mc._dict(mc._s("model"), mc._dict(mc._s("w"), mc._tensor("0", 4)), mc._s(key), extra_ops))
    return mc.torch_zip(path, pkl, {"0": bytes(16)})


# --- item 5: the C stack --------------------------------------------------------------------------

# MARK, then POP with nothing above the mark pops the mark in the C unpickler. The prescan popped the item
# below instead, its model ran out at the next TUPLE1 and it stopped walking: everything after reached the
# unpickler unchecked (a 300k-deep tuple hashed as a dict key: SIGSEGV in every carrier).
DESYNC = b"(K\x01(0"  # MARK, 1, MARK, POP  -> C: [MARK, 1]


def _desync_deep_key(depth: int = 300_000) -> bytes:
    return b"\x80\x02" + DESYNC + b"\x85" * depth + b"K\x02d."  # {(((1,),...),): 2} built by DICT


def _desync_memo(index: int = 10**8) -> bytes:
    return b"\x80\x02" + DESYNC + b"\x85K\x02dr" + struct.pack("<I", index) + b"."


def test_a_stack_desync_cannot_hide_a_deep_tuple_key(base, tmp_path):
    """The same desync in four carriers (a raw pickle, a torch.save zip's data.pkl, a legacy stream's object,
    a real dcp.save folder's .metadata): exit 2 with the exact line, never a signal; in an HF folder's
    training_args.bin, which is read statically and never unpickled: exit 0. A memo index of 10**8 behind
    the desync (the C unpickler's memo array grown to it: 1.5 GB) too."""
    import torch.distributed.checkpoint as dcp

    deep = _desync_deep_key()
    # the control: a shallow one is a stream the C unpickler accepts
    assert pickle.loads(b"\x80\x02" + DESYNC + b"\x85" * 3 + b"K\x02d.") == {(((1,),),): 2}
    raw = tmp_path / "raw.pth"
    raw.write_bytes(deep)
    zipped = mc.torch_zip(tmp_path / "zipped.pth", deep, {})
    legacy = tmp_path / "legacy.pth"
    legacy.write_bytes(pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2) + pickle.dumps(1001, protocol=2)
                       + pickle.dumps({}, protocol=2) + deep)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.zeros(3)}}, checkpoint_id=str(tmp_path / "dcp"))
    (tmp_path / "dcp" / ".metadata").write_bytes(deep)
    hf = tmp_path / "hf"
    hf.mkdir()
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(4)}, str(hf / "model.safetensors"), metadata={"format": "pt"})
    (hf / "training_args.bin").write_bytes(deep)
    memo = tmp_path / "memo.pth"
    memo.write_bytes(_desync_memo())
    cases = {"raw": raw, "zipped": zipped, "legacy": legacy, "dcp": tmp_path / "dcp", "hf": hf}
    jobs = {name: ["inspect", str(p)] for name, p in cases.items()}
    jobs["memo"] = ["inspect", str(memo)]
    out = _run(jobs, tmp_path)
    origin = {"raw": raw, "zipped": zipped, "legacy": legacy, "dcp": tmp_path / "dcp" / ".metadata"}
    assert out["hf"]["code"] == 0 and "training_args.bin is a pickled class: read statically" in out["hf"]["stdout"]
    for name in origin:
        assert (out[name]["code"], out[name]["stderr"].strip()) == (2, f"{ERR}{origin[name]}: {DEEP_TUPLE}"), out[name]
    assert (out["memo"]["code"], out["memo"]["stderr"].strip()) == (
        2, f"{ERR}{memo}: corrupt pickle (memo index 100000000 in a pickle of {len(_desync_memo())} bytes)"), out["memo"]


def test_pop_on_a_mark_is_modelled_not_refused():
    """Protocol 0 pickles a recursive tuple with POPs that end by popping its MARK: read as pickle reads it."""
    from ckptfix.formats.pickle_safe import load_pickle

    items: list = []
    loop = (items, 1)
    items.append(loop)
    data = pickle.dumps({"model": {}, "x": loop}, protocol=0)
    assert b"00" in data  # POP POP ...: the last pops the MARK
    tree = load_pickle(data, "p0")
    assert tree["x"][0][0] is tree["x"] and tree["x"][1] == 1


def test_integers_past_the_conversion_limit_are_one_line(base, tmp_path):
    """A 5000-digit INT in a pickle (int() refuses past 4300 digits) and a 5000-digit added_tokens_decoder key."""
    path = _zip_with_extra(tmp_path / "digits.pth", b"I" + b"9" * 5000 + b"\n")
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.model").write_bytes(Path(base["tok"]).read_bytes())
    (tok / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"9" * 5000: {"content": "x"}}}))
    out = _run({"int": ["inspect", str(path)], "key": ["inspect", str(base["good"]), "--tokenizer", str(tok)]}, tmp_path)
    assert (out["int"]["code"], out["int"]["stderr"].strip()) == (
        2, f"{ERR}{path}: pickle holds an integer of 5,000 digits; no checkpoint value is that wide")
    assert (out["key"]["code"], out["key"]["stderr"].strip()) == (
        2, f"{ERR}{tok / 'tokenizer_config.json'}: bad added_tokens_decoder entry '{'9' * 40}...'")


def test_a_deflated_data_pkl_lying_about_its_size_is_never_inflated_whole(base, tmp_path):
    """A deflated data.pkl: a real pickle and 256 MiB of zeros after its STOP (256 KB deflated), its zip entries
    claiming the pickle's size. zipfile's read() inflated the whole stream in one call; now 1 MiB at a time."""
    members = mc.zip_members(base["good"])
    pkl_name = next(n for n, _ in members if n.endswith("/data.pkl"))
    pkl = dict(members)[pkl_name]
    path = tmp_path / "lying.pth"
    mc.write_zip(path, [(n, pkl + bytes(256 << 20) if n == pkl_name else b) for n, b in members], compress=(pkl_name,))
    info = zipfile.ZipFile(path).getinfo(pkl_name)
    data = bytearray(path.read_bytes())
    for at in (info.header_offset + 22, data.rfind(b"PK\x01\x02", 0, data.find(pkl_name.encode(), data.find(b"PK\x01\x02")) + 1) + 24):
        struct.pack_into("<I", data, at, len(pkl))  # local header and central directory: uncompressed size
    path.write_bytes(bytes(data))
    code, peak = _python_peak(["inspect", str(path)])
    assert code == 2 and peak < 32 << 20, (code, peak >> 20)
    r = _run({"x": ["inspect", str(path)]}, tmp_path)["x"]
    assert (r["code"], r["stderr"].strip()) == (2, f"{ERR}{path}: cannot read data.pkl: Bad CRC-32 for file '{pkl_name}'"), r


def test_a_sparse_6_gb_legacy_file_that_cannot_be_mapped_is_one_line(tmp_path):
    """A legacy stream's head followed by a 6 GB hole, read under a 2 GB address-space limit (mmap: ENOMEM)."""
    path = tmp_path / "sparse.pth"
    path.write_bytes(pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2))
    with open(path, "r+b") as f:
        f.truncate(6 << 30)
    # the limit is set after the imports, from the address space they took (VmSize), leaving 3 GB: less than the map
    code = ("import re, resource, sys; from ckptfix.cli import main; "
            "size = int(re.search(r'VmSize:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) << 10; "
            "resource.setrlimit(resource.RLIMIT_AS, (size + (3 << 30),) * 2); main(['inspect', sys.argv[1]])")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"{ERR}{path}: cannot map the legacy stream (") and \
        r.stderr.strip().endswith(f"a file of {6 << 30:,} bytes"), r.stderr


def test_dag_shaped_structures_are_walked_once(base, tmp_path):
    """An HF index naming one shard 400 ways (./a, .//a, ...), a real dcp.save folder whose storage
    transform_descriptors are a 40-level memo-shared list DAG (printed: 2**40 steps), and a PEFT adapter whose
    lora_B is a stride-0 view 2**22 x 256 of one row: each read once, in seconds."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    hf = tmp_path / "hf400"
    hf.mkdir()
    tensors = {f"l{i}.weight": torch.zeros(4) for i in range(2000)}
    save_file(tensors, str(hf / "model-00001-of-00001.safetensors"), metadata={"format": "pt"})
    weight_map = {n: "./" * (i % 400) + "model-00001-of-00001.safetensors" for i, n in enumerate(tensors)}
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.zeros(3)}}, checkpoint_id=str(tmp_path / "dcp"))
    # each _StorageInfo's transform_descriptors (None here) becomes a list DAG: read with the real classes
    # (our own file), then pickled back
    with open(tmp_path / "dcp" / ".metadata", "rb") as f:
        md = pickle.load(f)
    dag: list = ["x"]
    for _ in range(40):
        dag = [dag, dag]
    for info in md.storage_data.values():
        info.transform_descriptors = dag
    with open(tmp_path / "dcp" / ".metadata", "wb") as f:
        pickle.dump(md, f)
    lora = tmp_path / "lora"
    lora.mkdir()
    (lora / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "target_modules": ["q"]}))
    row = torch.zeros(256)
    torch.save({"base_model.model.q.lora_A.weight": torch.zeros(8, 16),
                "base_model.model.q.lora_B.weight": row.expand(1 << 22, 256)}, lora / "adapter_model.bin")
    out = _run({"hf": ["inspect", str(hf)], "dcp": ["inspect", str(tmp_path / "dcp")],
                "lora": ["inspect", str(lora)], "lora_scan": ["inspect", str(lora), "--scan"]}, tmp_path, timeout=30)
    assert out["hf"]["code"] == 0, out["hf"]
    assert "2000 tensors" in out["hf"]["stdout"], out["hf"]["stdout"]
    assert out["dcp"]["code"] == 2 and out["dcp"]["stderr"].startswith(
        f"{ERR}{tmp_path / 'dcp' / '.metadata'}: storage of 'model.w': transform_descriptors item: expected a string"), out["dcp"]
    for job in ("lora", "lora_scan"):
        assert out[job]["code"] == 1 and "CKF601" in out[job]["stdout"], out[job]


# --- item 6: the second corpus's classes ----------------------------------------------------------

def _ndtype(code: str) -> bytes:
    return (G("numpy", "dtype") + b"(" + mc._s(code) + b"\x89\x88tR"
            + b"(K\x03" + mc._s("<") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb")


def _np_scalar(code: str) -> bytes:
    return G("numpy.core.multiarray", "scalar") + b"(" + _ndtype(code) + b"C\x03abctR"


def _lightning(path: Path, hparams_ops: bytes) -> Path:
    """A Lightning-shaped torch.save zip whose hyper_parameters hold `hparams_ops`."""
    pkl = mc._pickle(mc._dict(mc._s("state_dict"), mc._dict(mc._s("w"), mc._tensor("0", 4)),
                              mc._s("optimizer_states"), b"]", mc._s("lr_schedulers"), b"]",
                              mc._s("pytorch-lightning_version"), mc._s("2.4.0"),
                              mc._s("loops"), b"}", mc._s("callbacks"), b"}",  # what fit(ckpt_path=) reads: CKF317
                              mc._s("hyper_parameters"), mc._dict(mc._s("x"), hparams_ops)))
    return mc.torch_zip(path, pkl, {"0": bytes(16)})


BIG = (1 << 40) - 1
ZERO_ARRAY = (G("numpy.core.multiarray", "_reconstruct") + b"(" + G("numpy", "ndarray") + mc._i(0) + b"\x85"
              + b"C\x01btR" + b"(K\x01" + mc._i(0) + mc._i(BIG) + mc._i(BIG) + b"\x87" + _ndtype("f4") + b"\x89C\x00tb")
NAMESPACE_400 = (G("argparse", "Namespace") + b")\x81}" + mc._s("a")) * 400 + mc._i(1) + b"sb" * 400
CONVERT_CASES = {  # name: (extra ops, where convert stops: path, class, why)
    **{f"dtype_{c}": (_np_scalar(c), f"extra: numpy.core.multiarray.scalar is not convertible: numpy dtype '{c}' is "
                      "not one numpy knows (numpy refuses it too)") for c in ("f3", "c1", "i0", "u3")},
    "timedelta": (G("datetime", "timedelta") + b"(" + mc._i(BIG) + mc._i(0) + mc._i(0) + b"tR",
                  "extra: datetime.timedelta is not convertible: timedelta out of range (Python's limit is "
                  "999,999,999 days)"),
    "zero_array": (ZERO_ARRAY, "extra: numpy.core.multiarray._reconstruct is not convertible: numpy array of shape "
                   f"[0, {BIG}, {BIG}]: its strides exceed 2**63 bytes (numpy refuses it too)"),
    "namespace_400": (NAMESPACE_400, "extra" + ".a" * 99 + ": nested more than 100 deep; too deep to convert"),
}


def test_convert_refuses_what_is_not_data_and_leaves_nothing(tmp_path):
    """numpy dtype codes numpy rejects (also in Lightning hparams), a timedelta past Python's range, an empty
    0 x (2**40-1)**2 array, a Namespace nested 400 deep: inspect reads each (exit 0, no traceback); convert
    stops with one line and exit 2, and writes nothing."""
    jobs = {}
    for name, (ops, _) in CONVERT_CASES.items():
        path = _zip_with_extra(tmp_path / f"{name}.pth", ops)
        jobs[name] = ["inspect", str(path), "--json"]
        jobs[f"{name} convert"] = ["convert", str(path), "-o", str(tmp_path / f"{name}.out.pth")]
    lightning = _lightning(tmp_path / "lightning.ckpt", _np_scalar("f3"))
    jobs["lightning"] = ["inspect", str(lightning)]
    jobs["lightning convert"] = ["convert", str(lightning), "-o", str(tmp_path / "lightning.out.ckpt")]
    out = _run(jobs, tmp_path)
    for name, (_, line) in CONVERT_CASES.items():
        assert (out[name]["code"], out[name]["stderr"]) == (0, ""), out[name]
        assert (out[f"{name} convert"]["code"], out[f"{name} convert"]["stderr"].strip()) == (2, ERR + line)
    assert out["lightning"]["code"] == 0, out["lightning"]
    assert (out["lightning convert"]["code"], out["lightning convert"]["stderr"].strip()) == (
        2, f"{ERR}hyper_parameters.x: numpy.core.multiarray.scalar is not convertible: numpy dtype 'f3' is not one "
           "numpy knows (numpy refuses it too)")
    assert sorted(p.name for p in tmp_path.iterdir() if "out" in p.name) == []


def test_convert_checks_its_sidecar_before_writing_out(tmp_path):
    """A top-level list (its record goes to OUT.ckptfix.json) converted to an OUT whose name fits but whose
    sidecar's does not: refused before anything is written (OUT was left behind on exit 2)."""
    pkl = mc._pickle(b"]" + b"(" + G("argparse", "Namespace") + b")\x81}" + mc._s("a") + mc._i(1) + b"sbe")
    src = mc.torch_zip(tmp_path / "list.pth", pkl, {})
    out = tmp_path / ("o" * 240 + ".pth")
    r = _run({"x": ["convert", str(src), "-o", str(out)]}, tmp_path)["x"]
    assert r["code"] == 2 and r["stderr"].startswith(f"{ERR}{out}: name too long"), r
    assert not out.exists() and not any(p.name.startswith(".o") for p in tmp_path.iterdir())


def test_zero_size_tensors_with_a_2_62_dimension(base, tmp_path):
    """torch saves an empty (0, 2**62) tensor; numpy cannot shape it ("array is too big"): diff crashed, and
    plans that index its rows raised MemoryError. No real tensor has a dimension over 2**48: every command
    refuses it in one line."""
    sd = {"model": {**base["run"].model.state_dict(), "x": torch.empty(0, 2**62)}}
    torch.save(sd, tmp_path / "z.pth")
    out = _run({"diff": ["diff", str(tmp_path / "z.pth"), str(tmp_path / "z.pth")],
                "scan": ["inspect", str(tmp_path / "z.pth"), "--scan"],
                "repair": ["repair", str(tmp_path / "z.pth"), "--tokenizer", str(base["tok"]),
                           "-o", str(tmp_path / "out.pth")]}, tmp_path)
    for r in out.values():
        assert r["code"] == 2 and "tensor with a dimension over 2**48" in r["stderr"], r
        assert len(r["stderr"].splitlines()) == 1, r
    assert not (tmp_path / "out.pth").exists()


def test_tokenizer_claims_are_never_allocated(base, tmp_path):
    """A 14-byte tiktoken file ranking one token 16,777,215, a vocab.json {"a": 16777215}, a 120-byte
    tekken.json claiming 16M specials, an RWKV literal nested 100k deep (ast.literal_eval: MemoryError):
    one line each, exit 2, under 16 MB of Python allocation."""
    (tmp_path / "t.tiktoken").write_bytes(b"YQ== 16777215\n")
    (tmp_path / "enc").mkdir()
    (tmp_path / "enc" / "vocab.json").write_text('{"a": 16777215}')
    tekken = {"config": {"pattern": "x", "default_vocab_size": 16777215, "default_num_special_tokens": 16777214,
                         "version": "v7"}, "vocab": []}
    (tmp_path / "tekken.json").write_text(json.dumps(tekken))
    rwkv = tmp_path / "rwkv_vocab_v20230424.txt"
    rwkv.write_text("1 'a' 1\n2 'a' if " + "-" * 100_000 + "1 else '' 1\n")
    cases = {
        "tiktoken": (tmp_path / "t.tiktoken", "tiktoken ranks: 1 tokens but ids up to 16,777,215; not a vocabulary "
                     "(ids must be nearly dense)"),
        "vocab.json": (tmp_path / "enc" / "vocab.json", "vocab.json: 1 tokens but ids up to 16,777,215; not a "
                       "vocabulary (ids must be nearly dense)"),
        "tekken": (tmp_path / "tekken.json", "tekken vocab has fewer ranks than its vocab size"),
        "rwkv": (rwkv, "line 2: token literal too long"),
    }
    out = _run({n: ["inspect", str(base["good"]), "--tokenizer", str(p)] for n, (p, _) in cases.items()}, tmp_path)
    for name, (path, line) in cases.items():
        assert (out[name]["code"], out[name]["stderr"].strip()) == (2, f"{ERR}{path}: {line}"), out[name]
        code, peak = _python_peak(["inspect", str(base["good"]), "--tokenizer", str(path)])
        assert code == 2 and peak < 16 << 20, (name, peak >> 20)
    tekken["vocab"] = [{"rank": 0, "token_bytes": "YQ=="}]
    tekken["config"]["default_vocab_size"] = 16777215
    tekken["config"]["default_num_special_tokens"] = 16777214
    (tmp_path / "tekken2.json").write_text(json.dumps(tekken))
    r = _run({"x": ["inspect", str(base["good"]), "--tokenizer", str(tmp_path / "tekken2.json")]}, tmp_path)["x"]
    assert (r["code"], r["stderr"].strip()) == (2, f"{ERR}{tmp_path / 'tekken2.json'}: tekken config: "
                                                "default_num_special_tokens 16,777,214 with 20 listed; not a "
                                                "tekken.json (Mistral's have 1,000)"), r


def test_merges_and_added_tokens_are_linear(base, tmp_path):
    """12 MB of merges (3M lines; 767 MB before) and a tokenizer.json with 30k added tokens (10 s before)."""
    merges = tmp_path / "merges.txt"
    merges.write_text("#version: 0.2\n" + "a b\n" * 3_000_000)
    code, peak = _python_peak(["inspect", str(base["good"]), "--tokenizer", str(merges)])
    assert code in (0, 1) and peak < 400 << 20, (code, peak >> 20)
    from tokenizer_factory import train_tokenizer_json

    doc = json.loads(Path(train_tokenizer_json(tmp_path / "tj", 64)).read_text())
    doc["added_tokens"] = [{"id": 100 + i, "content": f"<extra_{i}>", "special": False, "single_word": False,
                            "lstrip": False, "rstrip": False, "normalized": False} for i in range(30_000)]
    (tmp_path / "added.json").write_text(json.dumps(doc))
    t = time.process_time()
    code, _ = _python_peak(["inspect", str(base["good"]), "--tokenizer", str(tmp_path / "added.json")])
    assert code in (0, 1) and time.process_time() - t < 3


# --- archives judged as torch and the safetensors library judge them --------------------------------

def _st(path: Path, header: dict, data: bytes) -> Path:
    return mc._safetensors(path, header, data)


SAFETENSORS_CASES = {  # name: (header, data, line after "<path>: ")
    "bool_dim": ({"w": {"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]}}, bytes(16),
                 "tensor 'w' has an invalid shape [True, 4]"),
    "gap": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
             "b": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}}, bytes(24),
            "tensor 'b' starts at data byte 16, not where the tensor before it ends (8): a gap in the data "
            "section; the safetensors library refuses the file too"),
    "trailing": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(16),
                 "8 bytes after the last tensor's data; the safetensors library refuses the file too"),
    "metadata_int": ({"__metadata__": {"format": 1}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
                     bytes(8), "safetensors __metadata__ is not an object of strings; the safetensors library "
                     "refuses the file too"),
}


def test_safetensors_judged_as_the_library_judges(tmp_path):
    """Each file is refused by the safetensors library itself (asserted), and by ckptfix with one line."""
    from safetensors import SafetensorError, safe_open

    paths = {n: _st(tmp_path / f"{n}.safetensors", h, d) for n, (h, d, _) in SAFETENSORS_CASES.items()}
    for path in paths.values():
        with pytest.raises(SafetensorError):
            with safe_open(str(path), "np"):
                pass
    out = _run({n: ["inspect", str(p), "--scan"] for n, p in paths.items()}, tmp_path)
    for name, (_, _, line) in SAFETENSORS_CASES.items():
        assert (out[name]["code"], out[name]["stderr"].strip()) == (2, f"{ERR}{paths[name]}: {line}"), out[name]


def test_zip_archives_judged_as_torch_judges(base, tmp_path):
    """A NUL in data.pkl's member name (zipfile cuts the name there, torch's miniz does not: torch finds no
    data.pkl), two members laid over the same bytes, a record longer than its storage (torch refuses it
    without mmap: CKF730), a big-endian archive (torch byte-swaps; ckptfix reads it byte-swapped too, so --scan
    finds its NaN, and refuses to write it rather than copy big-endian bytes under a 'little' record)."""
    torch.save({"a": torch.arange(4.0), "b": torch.tensor([1.0, float("nan")])}, tmp_path / "good.pth")
    members = mc.zip_members(tmp_path / "good.pth")
    prefix = members[0][0].split("/")[0]
    nul = tmp_path / "nul.pth"
    mc.write_zip(nul, [(n.replace("data.pkl", "data.pkl~a"), b) for n, b in members])
    nul.write_bytes(nul.read_bytes().replace(b"data.pkl~a", b"data.pkl\x00a"))
    longer = mc.write_zip(tmp_path / "long.pth", [(n, b + bytes(16) if n.endswith("/data/0") else b) for n, b in members])
    overlap = tmp_path / "overlap.pth"
    data = bytearray((tmp_path / "good.pth").read_bytes())
    offsets = {i.filename: i.header_offset for i in zipfile.ZipFile(tmp_path / "good.pth").infolist()}
    at = data.find(b"PK\x01\x02") - 1
    while (at := data.find(b"PK\x01\x02", at + 1)) >= 0:
        name_len = struct.unpack_from("<H", data, at + 28)[0]
        if data[at + 46:at + 46 + name_len] == f"{prefix}/data/1".encode():
            struct.pack_into("<I", data, at + 42, offsets[f"{prefix}/data/0"])
    overlap.write_bytes(bytes(data))
    big = tmp_path / "big.pth"
    swapped = {f"{prefix}/data/0": torch.arange(4.0).numpy().astype(">f4").tobytes(),
               f"{prefix}/data/1": torch.tensor([1.0, float("nan")]).numpy().astype(">f4").tobytes(),
               f"{prefix}/byteorder": b"big"}
    mc.write_zip(big, [(n, swapped.get(n, b)) for n, b in members])
    # torch's own judgement of each
    with pytest.raises(RuntimeError, match="failed locating file data.pkl"):
        torch.load(nul, weights_only=True)
    with pytest.raises(RuntimeError, match="does not match expected size"):
        torch.load(longer, weights_only=True)
    assert torch.isnan(torch.load(big, weights_only=True)["b"][1])
    out = _run({"nul": ["inspect", str(nul)], "long": ["inspect", str(longer)], "overlap": ["inspect", str(overlap)],
                "big": ["inspect", str(big), "--scan"], "big_repair": ["repair", str(big), "--tokenizer", str(base["tok"]), "-o", str(tmp_path / "o.pth")]},
               tmp_path)
    assert (out["nul"]["code"], out["nul"]["stderr"].strip()) == (
        2, f"{ERR}{nul}: zip member name '{prefix}/data.pkl\\x00a' holds a NUL byte; Python and torch.load's zip "
           "reader would read different members; refusing it"), out["nul"]
    assert out["long"]["code"] == 1 and "CKF730" in out["long"]["stdout"] and \
        "1 record(s) are longer than their storage: data/0 (32 bytes for 16)" in out["long"]["stdout"], out["long"]
    assert (out["overlap"]["code"], out["overlap"]["stderr"].strip()) == (
        2, f"{ERR}{overlap}: zip members '{prefix}/data/0' and '{prefix}/data/1' overlap in the file (one's bytes "
           "would be read as the other's); not an archive torch.save writes"), out["overlap"]
    assert out["big"]["code"] == 1 and "error   CKF501" in out["big"]["stdout"] and "tensors: b" in out["big"]["stdout"]
    assert out["big_repair"]["code"] == 2 and len(out["big_repair"]["stderr"].strip().splitlines()) == 1
    assert not (tmp_path / "o.pth").exists()
