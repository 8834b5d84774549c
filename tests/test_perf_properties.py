"""The properties ckptfix's speed rests on, guarded without timing anything precisely (bench/run.py times it).

- inspect reads metadata only: tensor bytes are never mapped except 1-element `step`s, so garbage in
  (or holes punched through) every other record leaves the report unchanged;
- inspect (and a streamed repair that samples nothing) never imports torch;
- the torch-free allowlist reader agrees with torch.load(weights_only=True) on every tensor;
- a streamed repair equals the load-everything-and-torch.cat script, and torch.load(mmap=True) reads it;
- inspect of a checkpoint with a 200 MB (sparse) data region stays fast and small;
- the source hash of a repair paces itself behind the copy (a checkpoint larger than memory is read once).
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_factory import new_run, save_checkpoint, train

import ckptfix
from ckptfix import io as ckio
from ckptfix.checkpoint import TensorInfo, read_scalar, release_maps
from ckptfix.formats import common, torch_file

REPO = Path(__file__).resolve().parents[1]
VOCAB = 64
EXTRA = 3
EMBED, HEAD = "text_embedding.weight", "text_head.weight"



def word_level_tokenizer(path: Path, size: int) -> Path:
    """A tokenizer.json with exactly `size` ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, **{f"t{i}": i for i in range(1, size)}}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def run():
    return train(new_run(VOCAB, dim=16, layers=2), 3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, run) -> Path:
    return save_checkpoint(run, tmp_path_factory.mktemp("perf") / "ckpt.pth")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return word_level_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", VOCAB + EXTRA)


def tensor_records(path: Path) -> list[tuple[str, int, int, int]]:
    """(key, start, length, numel) of every storage record of a torch.save zip."""
    tree, locate_for, archive = torch_file.load(str(path))
    seen, out = set(), []
    for ref in common.iter_tensor_refs(tree):
        if ref.storage.key not in seen:
            seen.add(ref.storage.key)
            where = archive.record_range(ref.storage.key)
            out.append((ref.storage.key, where.start, where.length, ref.storage.numel))
    return out


def report_json(path: Path) -> dict:
    release_maps()
    return ckptfix.inspect(str(path)).to_json()


# (a) inspect does not read tensor data --------------------------------------------------------------

def test_inspect_report_ignores_tensor_bytes(ckpt, tmp_path):
    before = report_json(ckpt)
    damaged = tmp_path / "garbage.pth"
    damaged.write_bytes(ckpt.read_bytes())
    records = tensor_records(damaged)
    overwritten = 0
    with open(damaged, "r+b") as f:
        for _, start, length, numel in records:
            if numel > 1:  # 1-element records are the optimizer `step`s inspect reports
                f.seek(start)
                f.write(b"\xff" * length)  # NaN in every float dtype
                overwritten += 1
    assert overwritten >= 10
    after = report_json(damaged)
    assert {**after, "path": None} == {**before, "path": None}
    assert not any(f["code"] == "CKF703" for f in after["findings"])  # no --verify: CRCs not read either


def test_inspect_maps_only_one_element_tensors(ckpt, monkeypatch):
    import ckptfix.checkpoint as checkpoint

    mapped: list[str] = []
    real = checkpoint._mapped_storage

    def spy(tensor, writable=False):
        mapped.append(f"{tensor.name} numel={tensor.numel}")
        return real(tensor, writable)

    real_read = TensorInfo.read

    def read_steps_only(self):
        assert self.numel == 1, f"inspect read the values of {self.name}"
        return real_read(self)

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"inspect made a torch tensor of {self.name}")

    real_scalar = checkpoint.read_scalar

    def spy_scalar(tensor, maps=None):  # steps are read with struct from the shared map, without numpy
        mapped.append(f"{tensor.name} numel={tensor.numel}")
        return real_scalar(tensor, maps)

    monkeypatch.setattr(checkpoint, "_mapped_storage", spy)
    monkeypatch.setattr(checkpoint, "read_scalar", spy_scalar)
    import ckptfix.formats.common as common

    monkeypatch.setattr(common, "read_scalar", spy_scalar)
    monkeypatch.setattr(TensorInfo, "read", read_steps_only)
    monkeypatch.setattr(TensorInfo, "to_torch", refuse)
    report = report_json(ckpt)
    assert report["optimizer"]["step"] == 3.0
    assert mapped and all(m.endswith("numel=1") for m in mapped), mapped


def test_small_slices_of_the_shared_map_read_the_file(ckpt):
    """file_map() answers small slices with pread() (no megabytes of read-around per cold page fault):
    every slice, small or large, must still be exactly the file's bytes."""
    from ckptfix.checkpoint import file_map

    raw = ckpt.read_bytes()
    mapped = file_map(str(ckpt))
    n = len(raw)
    for a, b in [(0, 4), (0, 30), (n - 22, n), (-22, None), (100, 100 + (1 << 16)), (100, 100 + (1 << 16) + 1),
                 (0, n), (5, 5), (n - 3, n + 10), (7, 3)]:
        assert mapped[a:b] == raw[a:b], (a, b)
    assert mapped[::7] == raw[::7] and mapped[10] == raw[10]
    assert np.frombuffer(mapped, dtype=np.uint8, count=8).tobytes() == raw[:8]


# (b) inspect does not import torch -----------------------------------------------------------------

NO_TORCH = r"""
import contextlib, io, json, sys
import ckptfix.cli
result = {}
for label, argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            ckptfix.cli.main(argv)
        except SystemExit as exc:
            code = exc.code
    result[label] = {"exit": code, "torch": "torch" in sys.modules, "head": out.getvalue()[:30]}
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def hf_trainer_folder(tmp_path_factory, run) -> Path:
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("hf") / "checkpoint-3"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in run.model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "model_type": "tiny"}))
    torch.save(run.optimizer.state_dict(), folder / "optimizer.pt")
    torch.save(run.scheduler.state_dict(), folder / "scheduler.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 3, "log_history": []}))
    return folder


def test_inspect_and_repair_never_import_torch(ckpt, hf_trainer_folder, tokenizer, tmp_path):
    """torch's import alone (~2 s) costs more than inspecting, or copying, a multi-GB checkpoint."""
    calls = [
        ("pth", ["inspect", str(ckpt), "--json"]),
        ("safetensors", ["inspect", str(hf_trainer_folder / "model.safetensors"), "--json"]),
        ("hf-folder", ["inspect", str(hf_trainer_folder), "--json"]),
        ("pth+tokenizer", ["inspect", str(ckpt), "--tokenizer", str(tokenizer), "--json"]),
        # rows added at the end, zeros init: records are copied, new rows computed with numpy
        ("repair-zeros", ["repair", str(ckpt), "--tokenizer", str(tokenizer), "-o", str(tmp_path / "r.pth"),
                          "--init", "zeros"]),
        # the default mean init and sampled normal rows are computed with numpy too
        ("repair-mean", ["repair", str(ckpt), "--tokenizer", str(tokenizer), "-o", str(tmp_path / "m.pth")]),
        ("repair-normal", ["repair", str(ckpt), "--tokenizer", str(tokenizer), "-o", str(tmp_path / "n.pth"),
                           "--init", "normal"]),
        # a folder with safetensors weights: whole tensors are produced (gathered), still without torch
        ("repair-hf", ["repair", str(hf_trainer_folder), "--tokenizer", str(tokenizer), "-o",
                       str(tmp_path / "hf-out")]),
    ]
    res = subprocess.run([sys.executable, "-c", NO_TORCH, json.dumps(calls)], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout.strip().splitlines()[-1])
    for label, r in result.items():
        assert r["exit"] in (0, 1, None), (label, r)
        assert not r["torch"], f"{label} imported torch"
        if not label.startswith("repair"):
            assert r["head"].lstrip().startswith("{"), (label, r)  # the JSON report was printed
    for name in ("r.pth", "m.pth", "n.pth", "hf-out/model.safetensors"):
        assert (tmp_path / name).exists(), name


# (c) the allowlist reader agrees with torch.load ---------------------------------------------------

def odd_tensors() -> dict:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    shared = torch.arange(24, dtype=torch.float32)
    return collections.OrderedDict([
        ("f32", torch.randn(4, 3, generator=g)),
        ("bf16", torch.randn(7, 2, generator=g).bfloat16()),
        ("f16", torch.randn(3, 3, generator=g).half()),
        ("f64", torch.randn(5, generator=g).double()),
        ("i64", torch.arange(-3, 9)),
        ("i32", torch.arange(5, dtype=torch.int32)),
        ("u8", torch.arange(200, 210, dtype=torch.uint8)),
        ("bool", torch.tensor([True, False, True])),
        ("param", torch.nn.Parameter(torch.randn(2, 4, generator=g))),
        ("transposed", base.t()),  # non-contiguous view
        ("rows", base[2:5]),  # a view at a storage offset, sharing base's storage
        ("shared_a", shared[:12].view(3, 4)),
        ("shared_b", shared[12:].view(4, 3)),  # two tensors, one storage
        ("scalar", torch.tensor(3.25)),
        ("scalar_bf16", torch.tensor(-1.5, dtype=torch.bfloat16)),
        ("empty", torch.empty(0, 4)),
        ("strided", torch.randn(8, 8, generator=g)[::2, 1::3]),
    ])


def assert_reader_agrees(path: Path, expected: dict, infos: dict[str, TensorInfo]) -> None:
    assert set(infos) == set(expected)
    for name, t in expected.items():
        info = infos[name]
        assert info.shape == tuple(t.shape), name
        assert info.dtype == str(t.dtype).removeprefix("torch."), name
        if info.stride is not None:
            assert tuple(info.stride) == t.stride(), name
            assert info.offset == t.storage_offset(), name
        values = t.detach().float().numpy() if t.dtype == torch.bfloat16 else t.detach().numpy()
        got = info.read()
        assert got.dtype == values.dtype, name
        assert np.array_equal(got, values, equal_nan=True), name
        if t.numel() == 1:
            assert read_scalar(info) == float(t), name


def _flat_infos(path: Path) -> tuple[dict[str, TensorInfo], dict]:
    tree, locate_for, _ = torch_file.load(str(path))
    return {k: common.tensor_from_ref(k, v, locate_for) for k, v in tree.items()}, tree


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_allowlist_reader_matches_torch_load(tmp_path, legacy):
    path = tmp_path / "odd.pth"
    torch.save(odd_tensors(), path, _use_new_zipfile_serialization=not legacy)
    expected = torch.load(path, weights_only=True)
    infos, tree = _flat_infos(path)
    assert_reader_agrees(path, expected, infos)
    assert tree["param"].is_parameter and isinstance(expected["param"], torch.nn.Parameter)
    assert infos["shared_a"].storage_id == infos["shared_b"].storage_id
    assert infos["rows"].storage_id == infos["transposed"].storage_id
    assert infos["f32"].storage_id != infos["shared_a"].storage_id


def test_allowlist_reader_matches_torch_load_on_a_training_checkpoint(ckpt):
    expected = torch.load(ckpt, weights_only=True)
    ck = ckptfix.read_checkpoint(str(ckpt))
    assert_reader_agrees(ckpt, expected["model"], ck.model)
    for index, ps in ck.optimizer.state.items():
        assert_reader_agrees(ckpt, {k: v for k, v in expected["optimizer"]["state"][index].items() if k != "step"},
                             ps.tensors)
        assert ps.step == float(expected["optimizer"]["state"][index]["step"])


def test_safetensors_reader_matches(tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = {k: v.detach().contiguous() for k, v in odd_tensors().items()
               if k not in ("shared_a", "shared_b", "transposed", "rows")}  # safetensors refuses shared storage
    path = tmp_path / "odd.safetensors"
    save_file(tensors, str(path))
    ck = ckptfix.read_checkpoint(str(path))
    assert_reader_agrees(path, load_file(str(path)), ck.model)


# (d) a streamed repair equals the naive script -----------------------------------------------------

def naive_resize(src: Path, out: Path, rows: int) -> None:
    """What users write: load everything, torch.cat zero rows to weights and moments, save everything."""
    sd = torch.load(src, weights_only=True)
    order = list(sd["model"])
    for name in (EMBED, HEAD):
        t = sd["model"][name]
        sd["model"][name] = torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])
        state = sd["optimizer"]["state"][order.index(name)]
        for key in ("exp_avg", "exp_avg_sq"):
            m = state[key]
            state[key] = torch.cat([m, m.new_zeros(rows - m.shape[0], *m.shape[1:])])
    torch.save(sd, out)


def test_streamed_repair_equals_naive_script(ckpt, tokenizer, tmp_path):
    repaired, naive = tmp_path / "repaired.pth", tmp_path / "naive.pth"
    ckptfix.repair(str(ckpt), str(tokenizer), str(repaired), init="zeros")
    naive_resize(ckpt, naive, VOCAB + EXTRA)
    a = torch.load(repaired, weights_only=True, mmap=True)
    b = torch.load(naive, weights_only=True)
    assert set(a) - set(b) == {"ckptfix"}
    assert a["scheduler"] == b["scheduler"] and a["scaler"] == b["scaler"]
    order = list(b["model"])
    resized = {("model", n) for n in (EMBED, HEAD)} | {
        ("state", order.index(n), k) for n in (EMBED, HEAD) for k in ("exp_avg", "exp_avg_sq")}
    pairs = [(("model", n), a["model"][n], b["model"][n]) for n in b["model"]]
    for i, entries in b["optimizer"]["state"].items():
        pairs += [(("state", i, k), a["optimizer"]["state"][i][k], v) for k, v in entries.items()]
    for where, x, y in pairs:
        assert x.dtype == y.dtype and x.shape == y.shape, where
        if where not in resized:
            assert torch.equal(x, y), where
            continue
        assert x.shape[0] == VOCAB + EXTRA
        assert torch.equal(x[:VOCAB], y[:VOCAB]), where  # old rows bit for bit
        if where[-1] == "exp_avg_sq":  # by design: the old rows' column mean, not zero
            torch.testing.assert_close(x[VOCAB:], y[:VOCAB].mean(0).expand(EXTRA, -1), rtol=1e-6, atol=0)
        else:
            assert torch.equal(x[VOCAB:], y[VOCAB:]), where
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]


@pytest.mark.parametrize("init", ["zeros", "mean", "normal"])
def test_stream_and_produce_give_the_same_tensor(ckpt, tokenizer, init):
    """The streaming writer (raw prefix copy + new rows) and the materialising one agree on every edit."""
    from ckptfix.formats.torch_save import Spliced, tensor_bytes
    from ckptfix.inspect import analyse
    from ckptfix.surgery.plan import make_plan
    from ckptfix.tokenizers import load_tokenizer

    tok = load_tokenizer(str(tokenizer))
    plan = make_plan(analyse(ckptfix.read_checkpoint(str(ckpt)), tok), tok, options=ckptfix.RepairOptions(init=init))
    edits = list(plan.weights.values()) + list(plan.moments.values())
    assert len(edits) == 6
    g_stream, g_produce = np.random.default_rng(7), np.random.default_rng(7)
    for edit in edits:
        spliced = edit.stream(init, 0.02, g_stream)
        assert isinstance(spliced, Spliced), edit.name
        with open(spliced.prefix.file, "rb") as f:
            f.seek(spliced.prefix.start)
            streamed = f.read(spliced.prefix.length) + bytes(tensor_bytes(spliced.tail))
        produced = bytes(tensor_bytes(edit.produce(init, 0.02, g_produce)))
        assert streamed == produced, edit.name


# (e) inspect of a large (sparse) data region stays fast and small ----------------------------------

MEASURE = r"""
import json, sys, time
import ckptfix, ckptfix.cli, numpy
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
ckptfix.inspect(sys.argv[2])  # warm every lazily imported module on a small file
rss0 = status("VmRSS")
t = time.perf_counter()
report = ckptfix.inspect(sys.argv[1])
report.to_json()
print(json.dumps({"s": time.perf_counter() - t, "rss_growth": status("VmHWM") - rss0,
                  "tensors": report.to_json()["model"]["tensors"]}))
"""


def punch_hole(path: Path, start: int, length: int) -> bool:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fd = os.open(path, os.O_RDWR)
    try:  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        return libc.fallocate(fd, 0x02 | 0x01, start, length) == 0
    finally:
        os.close(fd)


def test_inspect_of_a_large_sparse_checkpoint_is_fast_and_small(tmp_path, ckpt):
    big = 50 * 1024 * 1024  # 200 MB of float32
    path = tmp_path / "big.pth"
    model = collections.OrderedDict([("embed_tokens.weight", torch.empty(big // 1024, 1024)),
                                     ("norm.weight", torch.ones(1024))])
    torch.save({"model": model, "step": 1}, path)
    del model
    before = report_json(path)
    (key, start, length, _), = [r for r in tensor_records(path) if r[3] == big]
    first = (start + 4095) // 4096 * 4096
    if not punch_hole(path, first, (start + length) // 4096 * 4096 - first):
        pytest.skip("this filesystem cannot punch holes")
    assert os.stat(path).st_blocks * 512 < 20 * 1024 * 1024  # the data region is now a hole
    assert report_json(path) == before  # and inspect neither noticed nor cared
    res = subprocess.run([sys.executable, "-c", MEASURE, str(path), str(ckpt)], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    m = json.loads(res.stdout.strip().splitlines()[-1])
    assert m["tensors"] == 2
    assert m["rss_growth"] < 50 * 1024 * 1024, m  # not the 200 MB of data


def test_streamed_repair_of_megabyte_records_is_aligned_and_loads_with_mmap(tmp_path):
    """Every record is 64-byte aligned (torch.load(mmap=True) maps it) and at the offset torch.save gives it:
    torch.load(map_location="meta") computes offsets instead of reading them. (Records used to be copied at
    their source's offset within a page, for whole-page kernel copies; torch's meta loader then read the
    wrong bytes: issue 17 asks for torch.save's exact layout.)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(512, 1024), torch.nn.Linear(1024, 1024, bias=False),
                                torch.nn.Linear(1024, 512, bias=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    src, out = tmp_path / "big.pth", tmp_path / "big.fixed.pth"
    torch.save({"model": {"embed_tokens.weight": model[0].weight, "layers.0.weight": model[1].weight,
                          "lm_head.weight": model[2].weight},
                "optimizer": opt.state_dict()}, src)
    tok = word_level_tokenizer(tmp_path / "tok.json", 512 + EXTRA)
    ckptfix.repair(str(src), str(tok), str(out), init="zeros")
    a, b = torch.load(out, weights_only=True, mmap=True), torch.load(src, weights_only=True)
    for name, t in b["model"].items():
        assert torch.equal(a["model"][name][:len(t)], t)
        assert a["model"][name].shape == ((512 + EXTRA, 1024) if name != "layers.0.weight" else (1024, 1024))
    for i, entries in b["optimizer"]["state"].items():
        for key, t in entries.items():
            new = a["optimizer"]["state"][i][key]
            assert torch.equal(new[:len(t)] if t.dim() else new, t)

    def records(path: Path) -> dict[str, tuple[int, int]]:
        tree, _, archive = torch_file.load(str(path))
        names = {}
        for where, t in [(("model", n), v) for n, v in tree["model"].items()] + [
                (("state", i, k), v) for i, e in tree["optimizer"]["state"].items() for k, v in e.items()]:
            r = archive.record_range(t.storage.key)
            names[where] = (r.start, r.length)
        return names

    before, after = records(src), records(out)
    assert all(start % 64 == 0 for start, _ in after.values())
    big = [w for w in before if before[w][1] >= 1 << 20]
    copied = [w for w in big if after[w][1] == before[w][1]]
    assert len(big) == 9 and len(copied) == 3  # the middle layer and its moments; 6 resized (spliced) records
    (tmp_path / "again").mkdir()
    resaved = tmp_path / "again" / "big.pth"  # torch.save names the archive folder after the file: "big" too
    torch.save(torch.load(out, weights_only=True), resaved)
    first = min(r[0] for r in after.values()), min(r[0] for r in records(resaved).values())
    # the same records laid out the same way (data.pkl, before them, is pickled by another pickler)
    assert {w: r[0] - first[1] for w, r in records(resaved).items()} == {w: r[0] - first[0] for w, r in after.items()}
    meta = torch.load(out, weights_only=True, map_location="meta")
    assert meta["model"]["embed_tokens.weight"].shape == (512 + EXTRA, 1024)


def _settled(hasher, seconds=0.3):
    last = -1
    while last != hasher.position:
        last = hasher.position
        threading.Event().wait(seconds)
    return last


def test_source_hash_stays_within_its_lead_of_the_copy(tmp_path):
    data = os.urandom(8 << 20)
    src, dst = tmp_path / "src.bin", tmp_path / "dst.bin"
    src.write_bytes(data)
    mb, chunk = 1 << 20, 1 << 18
    with open(src, "rb") as s, open(dst, "wb") as d:
        hasher = ckio.BackgroundHash(str(src), paced=True, lead=mb, stall=60.0, chunk=chunk)
        assert _settled(hasher) == mb + chunk  # the lead hashed before any copy; waits to read the next chunk
        ckio.copy_range(s.fileno(), d.fileno(), 0, 0, 2 * mb)
        assert _settled(hasher) == 3 * mb + chunk
        ckio.copy_range(s.fileno(), d.fileno(), 2 * mb, 2 * mb, 4 * mb)
        assert _settled(hasher) == 7 * mb + chunk
        assert hasher.result() == hashlib.sha256(data).hexdigest()  # the writer is done: it finishes
    assert dst.read_bytes() == data[:6 * mb] and hasher not in ckio._pacers


def test_source_hash_goes_on_when_the_copy_stalls_and_unpaced_never_waits(tmp_path):
    data = os.urandom(4 << 20)
    src, dst = tmp_path / "src.bin", tmp_path / "dst.bin"
    src.write_bytes(data)
    with open(src, "rb") as s, open(dst, "wb") as d:
        hasher = ckio.BackgroundHash(str(src), paced=True, lead=1 << 18, stall=0.2, chunk=1 << 18)
        ckio.copy_range(s.fileno(), d.fileno(), 0, 0, 1 << 18)
        hasher.thread.join(10)  # no result() call: the copy stopped, and the stall timeout lets it finish
    assert not hasher.thread.is_alive() and hasher.value == hashlib.sha256(data).hexdigest()
    unpaced = ckio.BackgroundHash(str(src), chunk=1 << 18)
    unpaced.thread.join(10)
    assert unpaced.value == hashlib.sha256(data).hexdigest() and not ckio._pacers
