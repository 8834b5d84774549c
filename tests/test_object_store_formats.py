"""Every format ckptfix reads, in object storage (issue 34): a population, not a list.

`BUILDERS` maps each name of `ckptfix.formats.BY_NAME` to a function that builds a small real checkpoint of
that format (its framework's own writer, or a committed file its framework wrote) and a tokenizer to grow it
to; a format added to ckptfix fails `test_every_format_has_a_builder` until it gets one here (or a reason
string, which its tests report as a skip). For each format, against the real S3 API server of
`tests/s3_server.py` (moto's server mode, ckptfix's whole client stack):

1. `inspect` of the `s3://` copy equals `inspect` of the local one (text and `--json`, with and without
   `--scan`, strict reads: a byte read past `remote.ensure` is 0xFF);
2. `repair` from `s3://` into a local OUT writes what the local repair writes;
3. `repair` of the local copy with `-o s3://...` publishes what the local repair writes (downloaded with
   boto3, compared file by file), and `s3://` to `s3://` too (the record naming the URL, unhashed);
4. the published output loads through the framework's own fsspec path where one runs on CPU here
   (`torch.load` of an `fsspec` file, `dcp.load` with `FsspecReader`, Lightning's `cloud_io._load`, which
   `ckpt_path="s3://..."` and `Fabric.load` use; safetensors' `load` of the object's bytes), equal to the
   local output loaded from disk;
5. `--in-place` on the `s3://` copy leaves the objects the local in-place repair leaves in its folder.
A format repair (or --in-place) refuses must refuse alike: same exit code, same line, nothing written.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Callable

import pytest
from test_remote_read import _repairs_alike, _same_output, _same_tree, run

from ckptfix import remote
from ckptfix.formats import BY_NAME

ROOT = Path(__file__).resolve().parent.parent
EPOCH = "1700000000"

Built = tuple[Path, Path]  # (checkpoint, tokenizer to grow it to)


@pytest.fixture(autouse=True)
def strict(monkeypatch):
    monkeypatch.setattr(remote, "strict_reads", True)  # a byte read past remote.ensure shows as 0xFF
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)  # the record's `created`: both repairs write the same bytes


def _quiet(fn: Callable, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kw)


def _word_level(folder: Path, size: int) -> Path:
    from arch_corpus import word_level_tokenizer

    (folder / "tok").mkdir(exist_ok=True)  # beside, never inside, the checkpoint: reports name both paths
    return word_level_tokenizer(folder / "tok" / f"words{size}.json", size)


def _file_in(tmp: Path, name: str) -> Path:
    """A file checkpoint in a folder of its own: inspect's fix names a file's folder (`resume_hints`), and
    the tokenizer must not sit in that folder, which the comparison maps to its URL."""
    (tmp / "ckpt").mkdir()
    return tmp / "ckpt" / name


# --- one builder per format ----------------------------------------------------------------------------

OLD, NEW = 48, 64  # the TinyLM runs of ckpt_factory


def build_torch(tmp: Path) -> Built:
    from ckpt_factory import trained_checkpoint

    return trained_checkpoint(_file_in(tmp, "ckpt.pth"), OLD, steps=3), _word_level(tmp, NEW)


def build_safetensors(tmp: Path) -> Built:
    from ckpt_factory import new_run, train
    from safetensors.torch import save_file

    path = _file_in(tmp, "model.safetensors")
    save_file({k: v.contiguous() for k, v in train(new_run(OLD), 1).model.state_dict().items()}, str(path))
    return path, _word_level(tmp, NEW)


def build_lightning(tmp: Path) -> Built:
    pytest.importorskip("lightning")
    import torch
    from test_repair_lightning import LitLM, loader, trainer

    torch.manual_seed(0)
    fit = trainer(tmp / "root", 2)
    _quiet(fit.fit, LitLM(OLD), loader(OLD, 4, seed=1))
    path = _file_in(tmp, "last.ckpt")
    fit.save_checkpoint(path)
    return path, _word_level(tmp, NEW)


def build_composer(tmp: Path) -> Built:
    """Composer 0.32.1's own Trainer wrote this file (fixtures/frameworks_real.py, committed)."""
    path = ROOT / "fixtures" / "frameworks" / "composer" / "ep0-ba2-rank0.pt"
    return path, _word_level(tmp, 216)


def build_megatron(tmp: Path) -> Built:
    """megatron-core 0.16.1's own save (fixtures/megatron.py, committed): TP2 x DP2, Adam."""
    from test_formats_megatron import OLD_TOKENS
    from tokenizer_factory import extend_tokenizer_json, train_bpe_tokenizer_json

    (tmp / "tok").mkdir()
    old = train_bpe_tokenizer_json(tmp / "tok", OLD_TOKENS, name="old.json")
    new = extend_tokenizer_json(old, tmp / "tok" / "new.json", [f"new{i}" for i in range(100)])
    return ROOT / "fixtures" / "megatron" / "small-tp2-dp2-adam", new


def build_dcp(tmp: Path) -> Built:
    import torch.distributed.checkpoint as dcp
    from ckpt_factory import new_run, train
    from torch.distributed.checkpoint.state_dict import get_state_dict

    run_ = train(new_run(OLD), 3)
    msd, osd = get_state_dict(run_.model, run_.optimizer)
    path = tmp / "step-3"
    _quiet(dcp.save, {"model": msd, "optim": osd, "sched": run_.scheduler.state_dict(), "step": run_.step},
           checkpoint_id=str(path))
    return path, _word_level(tmp, NEW)


_ZERO_RUNS: dict[str, Path] = {}  # one ZeRO run serves both DeepSpeed formats (it is the slowest build)


def _zero_run(tmp: Path) -> Path:
    """A real 2-rank ZeRO-2 run on CPU (gloo) saved by `engine.save_checkpoint`: its tag folder."""
    pytest.importorskip("deepspeed")
    from test_formats_deepspeed_ranks import run_zero

    if "tag" not in _ZERO_RUNS:
        run_zero(tmp / "run", 2)
        _ZERO_RUNS["tag"] = tmp / "run" / "global_step3"
    return _ZERO_RUNS["tag"]


def build_deepspeed(tmp: Path) -> Built:
    from test_formats_deepspeed_ranks import VOCAB

    return _zero_run(tmp), _word_level(tmp, VOCAB + 16)


def build_deepspeed_universal(tmp: Path) -> Built:
    """The ZeRO-2 run converted by DeepSpeed's own ds_to_universal."""
    tag = _zero_run(tmp)
    from test_formats_deepspeed_ranks import VOCAB
    from test_repair_deepspeed_universal import _CONVERT

    folder = tmp / "global_step3_universal"
    subprocess.run([sys.executable, "-c", _CONVERT, str(tag), str(folder)], check=True, capture_output=True,
                   env={**os.environ, "DS_ACCELERATOR": "cpu"})
    return folder, _word_level(tmp, VOCAB + 16)


def build_litgpt(tmp: Path) -> Built:
    """litgpt's training checkpoint: `fabric.save(step-N/lit_model.pth, ...)` beside model_config.yaml."""
    pytest.importorskip("lightning")
    from test_frameworks import litgpt_checkpoint

    return litgpt_checkpoint(tmp)[2], _word_level(tmp, 300)


def build_peft_adapter(tmp: Path) -> Built:
    """A LoRA adapter with modules_to_save=[embed_tokens, lm_head] and the Trainer's optimizer.pt beside it."""
    peft = pytest.importorskip("peft")
    import torch
    from test_frameworks import NEW as GROWN
    from test_frameworks import VOCAB, _step, _tiny_llama

    model = _quiet(peft.get_peft_model, _tiny_llama(VOCAB), peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["embed_tokens", "lm_head"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    _step(model, opt, VOCAB, 1)
    src = tmp / "adapter"
    _quiet(model.save_pretrained, src)
    torch.save(opt.state_dict(), src / "optimizer.pt")
    return src, _word_level(tmp, GROWN)


class _Factory:
    """The one method of pytest's tmp_path_factory that a module fixture's body uses."""

    def __init__(self, root: Path):
        self.root = root

    def mktemp(self, name: str) -> Path:
        path = self.root / name
        path.mkdir()
        return path


def build_hf_trainer(tmp: Path) -> Built:
    """checkpoint-2 of a real transformers.Trainer run (tiny GPT-2, tied head)."""
    pytest.importorskip("transformers")
    from test_inspect_formats import trainer_checkpoint

    return trainer_checkpoint.__wrapped__(_Factory(tmp))[0], _word_level(tmp, 120)


def build_accelerate(tmp: Path) -> Built:
    """`Accelerator.save_state` after real AdamW steps (pytorch_model.bin: the module order kept)."""
    pytest.importorskip("accelerate")
    from test_repair_accelerate import build, train_on

    acc, model, opt, sched = build(OLD)
    train_on(acc, model, opt, sched, OLD, 2, seed=1)
    _quiet(acc.save_state, tmp / "state", safe_serialization=False)
    return tmp / "state", _word_level(tmp, NEW)


def build_hf_model(tmp: Path) -> Built:
    """A plain `save_pretrained` folder (model.safetensors + config.json, no optimizer)."""
    pytest.importorskip("transformers")
    from test_frameworks import NEW as GROWN
    from test_frameworks import VOCAB, _tiny_llama

    path = tmp / "llama"
    _tiny_llama(VOCAB).save_pretrained(path)
    return path, _word_level(tmp, GROWN)


# A format that cannot be built here maps to the reason (its tests skip with it).
BUILDERS: dict[str, Callable[[Path], Built] | str] = {
    "safetensors": build_safetensors,
    "torch": build_torch,
    "lightning": build_lightning,
    "composer": build_composer,
    "megatron": build_megatron,
    "dcp": build_dcp,
    "deepspeed-universal": build_deepspeed_universal,
    "deepspeed": build_deepspeed,
    "litgpt": build_litgpt,
    "peft-adapter": build_peft_adapter,
    "hf-trainer": build_hf_trainer,
    "accelerate": build_accelerate,
    "hf-model": build_hf_model,
}
# The real 2-rank DeepSpeed run (one for both formats) takes about 10 s here: in the default suite, where
# deepspeed is installed (CI's extras leave it out: skipped there).
MARKS = {"deepspeed": [pytest.mark.deepspeed], "deepspeed-universal": [pytest.mark.deepspeed],
         "lightning": [pytest.mark.lightning], "litgpt": [pytest.mark.lightning], "peft-adapter": [pytest.mark.peft],
         "accelerate": [pytest.mark.accelerate], "hf-trainer": [pytest.mark.transformers],
         "hf-model": [pytest.mark.transformers]}


def test_every_format_has_a_builder():
    assert set(BUILDERS) == set(BY_NAME)


def _formats():
    for name in BUILDERS:
        yield pytest.param(name, marks=MARKS.get(name, []), id=name)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Callable[[str], Built]:
    """Each format built once for the module's tests (a skip, such as a missing framework, is not cached)."""
    cache: dict[str, Built] = {}

    def get(name: str) -> Built:
        entry = BUILDERS[name]
        if isinstance(entry, str):
            pytest.skip(entry)
        if name not in cache:
            cache[name] = entry(tmp_path_factory.mktemp(name))
        return cache[name]

    return get


def _uploaded(s3, built, name: str) -> tuple[Path, str, Path]:
    """The checkpoint uploaded under a URL that ends as its local path does (folder and name), so that a
    path inspect derives from it (the `-o` its fix suggests, beside the input or its run folder) maps too."""
    local, tok = built(name)
    url = s3.url(f"{name}/{local.parent.name}/{local.name}")
    s3.upload(str(local), url)
    return local, url, tok


def _out_name(local: Path) -> str:
    return local.name if local.is_dir() else f"fixed{local.suffix}"


def _refuses(name: str) -> bool:
    return BY_NAME[name].write is None


# --- 1. inspect ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", _formats())
def test_inspect_from_s3_equals_local(s3, built, name):
    local, url, tok = _uploaded(s3, built, name)
    for flags in ([], ["--json"], ["--scan"], ["--scan", "--json"]):  # metadata only, then every tensor byte
        here = run("inspect", local, "--tokenizer", tok, *flags)
        there = run("inspect", url, "--tokenizer", tok, *flags)
        assert here.exit_code == there.exit_code, (here, there)
        assert there.stderr == _as_remote(here.stderr, local, url, tok)
        assert there.stdout == _as_remote(here.stdout, local, url, tok), there.stdout


def _as_remote(text: str, local: Path, url: str, tok: Path) -> str:
    """A local report as the remote one spells it: every path under the checkpoint's grandparent folder
    (the input, its folder, a name the fix suggests beside either) under the URL's, the tokenizer's kept."""
    kept = "\0tokenizer\0"
    text = text.replace(str(tok), kept)
    text = text.replace(str(local.parent.parent), url.rstrip("/").rsplit("/", 2)[0])
    return text.replace(kept, str(tok))


# --- 2. repair s3:// -> local OUT ----------------------------------------------------------------------

@pytest.mark.parametrize("name", _formats())
def test_repair_from_s3_equals_local(s3, built, name, tmp_path):
    local, url, tok = _uploaded(s3, built, name)
    (tmp_path / "here").mkdir()
    (tmp_path / "there").mkdir()
    if not _refuses(name):
        _repairs_alike(s3, local, url, tok, tmp_path, weights_only=name != "composer")  # Composer: see LOADERS
        return
    out = _out_name(local)
    here = run("repair", local, "-t", tok, "-o", tmp_path / "here" / out)
    there = run("repair", url, "-t", tok, "-o", tmp_path / "there" / out)
    _same_refusal(here, there, local, url, tok, tmp_path)


def _same_refusal(here, there, local: Path, url: str, tok: Path, tmp_path: Path) -> None:
    assert here.exit_code == there.exit_code == 2, (here, there)
    assert there.stderr == _as_remote(here.stderr, local, url, tok), there.stderr
    assert not list((tmp_path / "there").iterdir())


# --- 3. repair local -> s3:// OUT, and 4. loaded back through the framework's fsspec path ----------------

def _repaired_here_and_to_s3(s3, local: Path, source: object, tok: Path, tmp_path: Path):
    """(OUT's name, the repair of LOCAL into tmp_path/here, the repair of SOURCE into s3://.../out/), both
    ending alike."""
    out = _out_name(local)
    (tmp_path / "here").mkdir()
    here = run("repair", local, "-t", tok, "-o", tmp_path / "here" / out)
    there = run("repair", source, "-t", tok, "-o", s3.url(f"out/{out}"))
    assert here.exit_code == there.exit_code, (here, there)
    return out, here, there


@pytest.mark.parametrize("name", _formats())
def test_repair_to_s3_equals_local_and_loads_through_fsspec(s3, built, name, tmp_path):
    local, tok = built(name)
    out, here, there = _repaired_here_and_to_s3(s3, local, local, tok, tmp_path)
    if _refuses(name):
        assert here.exit_code == 2 and there.stderr == here.stderr, (here, there)
        assert s3.keys(s3.url("out/")) == []
        return
    assert here.exit_code == 0, here
    back = tmp_path / "back"
    s3.download(s3.url("out/"), str(back))
    _same_output(tmp_path / "here", back, weights_only=name != "composer")
    LOADERS.get(name, _no_loader)(s3.url(f"out/{out}"), tmp_path / "here" / out)


@pytest.mark.parametrize("name", _formats())
def test_repair_from_s3_to_s3_equals_local(s3, built, name, tmp_path):
    """Both ends in the store (unchanged bytes copied inside it where large enough): the local repair's files,
    the record naming the URL and not hashing the input."""
    local, url, tok = _uploaded(s3, built, name)
    out, here, there = _repaired_here_and_to_s3(s3, local, url, tok, tmp_path)
    if _refuses(name):
        assert there.stderr == _as_remote(here.stderr, local, url, tok), (here, there)
        assert s3.keys(s3.url("out/")) == []
        return
    back = tmp_path / "back"
    s3.download(s3.url("out/"), str(back))
    _same_output(tmp_path / "here", back, weights_only=name != "composer", unhashed=True)


# --- 5. --in-place on s3:// ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", _formats())
def test_in_place_on_s3_equals_local_in_place(s3, built, name, tmp_path):
    """The same in-place repair of a local copy and of the uploaded one: the objects afterwards are the local
    folder's files (the record naming its URL source, unhashed), or both refuse with the same line."""
    from test_object_store_in_place import same_outputs

    source, tok = built(name)
    local = tmp_path / source.parent.name / source.name
    local.parent.mkdir()
    (shutil.copytree if source.is_dir() else shutil.copy2)(source, local)
    url = s3.url(f"{name}/{source.parent.name}/{source.name}")
    s3.upload(str(source), url)
    uploaded = _objects(s3, name)
    here = run("repair", local, "-t", tok, "--in-place")
    there = run("repair", url, "-t", tok, "--in-place")
    assert here.exit_code == there.exit_code, (here, there)
    if here.exit_code != 0:
        assert here.exit_code == 2 and there.stderr == _as_remote(here.stderr, local, url, tok), (here, there)
        assert _objects(s3, name) == uploaded and _contents(local) == _contents(source)
        print(f"{name}: --in-place refused alike: {there.stderr.strip()}")
        return
    assert _contents(local) != _contents(source)
    back = tmp_path / "back"
    s3.download(url + "/", str(back))
    same_outputs(local, back, url)


def _contents(path: Path) -> dict:
    from test_repair_common import snapshot

    return snapshot(path) if path.is_dir() else {path.name: path.read_bytes()}


def _objects(s3, prefix: str) -> dict[str, str]:
    """key -> ETag of every object under the prefix."""
    pages = s3.client.get_paginator("list_objects_v2").paginate(Bucket=s3.name, Prefix=prefix + "/")
    return {o["Key"]: o["ETag"] for page in pages for o in page.get("Contents", [])}


def _no_loader(url: str, local: Path) -> None:
    """No fsspec-aware loader of this framework runs here: the byte comparison above is the check."""


def _torch_files(url: str, local: Path, *names: str, weights_only: bool = True) -> None:
    """`torch.load` of an `fsspec.open` file (what Lightning, torchtitan and others do with a URL) equals the
    local output's, for each named file of a folder (or the file itself)."""
    import fsspec
    import torch

    for name in names or ("",):
        with fsspec.open(f"{url}/{name}" if name else url, "rb") as f:
            there = torch.load(f, weights_only=weights_only)
        here = torch.load(local / name if name else local, weights_only=weights_only)
        _same_tree(here, there, name or local.name)


def _lightning_load(url: str, local: Path, name: str = "") -> None:
    """Lightning's own loader of a `ckpt_path`/`Fabric.load` URL (fsspec's filesystem for the scheme)."""
    import torch
    from lightning.fabric.utilities.cloud_io import _load

    there = _load(f"{url}/{name}" if name else url, weights_only=True)
    _same_tree(torch.load(local / name if name else local, weights_only=True), there, name or local.name)


def _safetensors_files(url: str, local: Path, *names: str) -> None:
    """safetensors' `load` of each object's bytes as fsspec reads them."""
    import fsspec
    from safetensors.torch import load, load_file

    for name in names or ("",):
        with fsspec.open(f"{url}/{name}" if name else url, "rb") as f:
            there = load(f.read())
        here = load_file(str(local / name if name else local))
        _same_tree(dict(sorted(here.items())), dict(sorted(there.items())), name or local.name)  # order: not data


def _dcp_load(url: str, local: Path) -> None:
    """`dcp.load` through torch's `FsspecReader` of every tensor the published `.metadata` lists, equal to
    the same load of the local output through `FileSystemReader`."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # not re-exported in torch 2.13
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    def tensors(reader) -> dict:
        meta = reader.read_metadata().state_dict_metadata
        state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
                 if isinstance(m, TensorStorageMetadata)}
        _quiet(dcp.load, state, storage_reader=reader)
        return state

    there = tensors(FsspecReader(url))
    assert there
    _same_tree(tensors(FileSystemReader(str(local))), there, local.name)


def _universal_files(url: str, local: Path) -> None:
    """Every file of the folder as DeepSpeed's universal loader reads it (`torch.load(..., weights_only=False)`:
    its optimizer_state.pt holds DeepSpeed's own objects)."""
    names = sorted(str(p.relative_to(local)) for p in local.rglob("*.pt"))
    _torch_files(url, local, *names, weights_only=False)


LOADERS: dict[str, Callable[[str, Path], None]] = {
    "torch": _torch_files,
    "composer": lambda url, local: _torch_files(url, local, weights_only=False),  # Composer keeps a TorchVersion
    "lightning": _lightning_load,
    "litgpt": lambda url, local: _lightning_load(url, local, "lit_model.pth"),
    "dcp": _dcp_load,
    "megatron": lambda url, local: _dcp_load(f"{url}/iter_0000002", local / "iter_0000002"),
    "safetensors": _safetensors_files,
    "hf-model": lambda url, local: _safetensors_files(url, local, "model.safetensors"),
    "hf-trainer": lambda url, local: (_safetensors_files(url, local, "model.safetensors"),
                                      _torch_files(url, local, "optimizer.pt", "scheduler.pt")),
    "peft-adapter": lambda url, local: (_safetensors_files(url, local, "adapter_model.safetensors"),
                                        _torch_files(url, local, "optimizer.pt")),
    "accelerate": lambda url, local: _torch_files(url, local, "pytorch_model.bin", "optimizer.bin"),
    "deepspeed-universal": _universal_files,
}


def test_a_table_saved_in_parts_repairs_from_and_to_s3_as_here(s3, tmp_path):
    """Molmo2TextModel's embedding in two parts (read as one `JoinedTensor`, saved as the parts again): inspect,
    repair from s3:// and repair to s3:// give the local results, and the parts come back as the local ones."""
    import json

    from arch_corpus import VOCAB, build_registry_model, registry_step, save_trainer_folder, trainer_optimizer
    from tokenizer_factory import extend_tokenizer_json

    model = build_registry_model("molmo2_text", "Molmo2TextModel", VOCAB)
    opt, sched = trainer_optimizer(model)
    registry_step(model, opt, sched, VOCAB, seed=1)
    local = save_trainer_folder(model, opt, sched, tmp_path / "run" / "checkpoint-1", step=1)
    tok = tmp_path / "new.json"
    extend_tokenizer_json(local / "tokenizer.json", tok, ["<a>", "<b>", "<c>"])
    url = s3.url(f"molmo/run/{local.name}")
    s3.upload(str(local), url)
    here, there = run("inspect", local, "--tokenizer", tok), run("inspect", url, "--tokenizer", tok)
    assert here.exit_code == there.exit_code == 1 and "wte.embedding+wte.new_embedding" in here.stdout
    assert there.stdout == _as_remote(here.stdout, local, url, tok)
    named = run("repair", url, "-t", tok, "-o", tmp_path / "named")  # the old tokenizer: the folder's own
    assert named.exit_code == 0, named
    notes = json.loads((tmp_path / "named" / "ckptfix.json").read_text())["notes"]
    assert f"rows moved by token string from the old tokenizer {url} (saved in the checkpoint folder)" in notes
    work = tmp_path / "from"  # named alike in both (a URL and a path otherwise)
    (work / "here").mkdir(parents=True)
    (work / "there").mkdir()
    _repairs_alike(s3, local, url, tok, work, "--from-tokenizer", local)
    into = tmp_path / "to"
    into.mkdir()
    out, here, there = _repaired_here_and_to_s3(s3, local, local, tok, into)
    assert here.exit_code == 0, here
    s3.download(s3.url("out/"), str(into / "back"))
    _same_output(into / "here", into / "back")
