"""The read side against a hostile corpus (tests/malicious_corpus.py), through the real CLI.

Every corpus input runs through `ckptfix inspect` in a separate process (plain, --json, --scan --verify,
--trust-pickle --json; plus --tokenizer where the case is about a tokenizer), batched into one runner
process so the file stays fast; two tests also run one input per true `python -m ckptfix.cli` process.
Asserted for every run: the sentinel a payload would create never appears, the exit code is the
documented one (2 for unreadable input, 1/0 for readable checkpoints with/without error findings,
never 3), an error is exactly one line `ckptfix: error: ...` naming the problem with no terminal escape
characters, nothing says "Traceback", --json prints valid JSON, nothing is written anywhere under the
corpus or the working directory, and every input is byte-identical afterwards.

The torch behaviours SECURITY.md quotes are measured here too, so the document stays true.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

import malicious_corpus as mc  # noqa: E402  (tests/ is on sys.path under pytest)

MODES: list[tuple[str, ...]] = [(), ("--json",), ("--scan", "--verify"), ("--trust-pickle", "--json")]
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f\x9b]")  # escape sequences start with ESC (\x1b) or CSI (\x9b)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("security")
    cases = mc.generate(root / "corpus")
    workdir = root / "cwd" / "deeper"  # "../../evil" from here would land inside root: watched too
    workdir.mkdir(parents=True)
    return root, cases, workdir


@pytest.fixture(scope="module")
def batch(corpus):
    """Every (case, mode) through `ckptfix.cli.main` in one separate process; snapshots around it."""
    root, cases, workdir = corpus
    jobs = [{"id": f"{c.name}|{' '.join(m)}", "argv": c.argv(*m)}
            for c in cases for m in MODES]
    before = mc.snapshot(root)
    results = mc.run_batch(jobs, cwd=workdir, timeout=20)
    after = mc.snapshot(root)
    return {"results": results, "before": before, "after": after, "jobs": jobs}


def _runs(cases, batch):
    for case in cases:
        for mode in MODES:
            yield case, mode, batch["results"][f"{case.name}|{' '.join(mode)}"]


def _json_error_problems(label: str, r: dict) -> list[str]:
    try:
        error = json.loads(r["stdout"])["error"]
    except (ValueError, KeyError, TypeError):
        return [f"{label}: stdout under --json is not one JSON error object: {r['stdout'][:200]!r}"]
    if error.get("exit_code") != 2 or r["stderr"].strip() != f"ckptfix: error: {error.get('message')}":
        return [f"{label}: the JSON error object does not match the stderr line: {r['stdout'][:200]!r}"]
    return []


def _fail(problems: list[str]) -> None:
    if problems:
        pytest.fail(f"{len(problems)} problem(s):\n" + "\n".join(problems[:60]))


# ----------------------------------------------------------------------------------------------------
# The contract, for every input and mode.


def test_corpus_covers_the_brief(corpus):
    _, cases, _ = corpus
    names = {c.name for c in cases}
    for needle in ("raw_pickle_os_system", "raw_pickle_popen", "raw_pickle_eval", "raw_pickle_exec",
                   "raw_pickle_getattr_chain", "torch_save_nested_", "torch_legacy_nested_", "zip_path_traversal",
                   "zip_central_dir_size_bigger", "zip_central_dir_size_smaller", "truncated_zip_in_central_dir",
                   "truncated_zip_in_data_pkl", "zero_byte_file", "directory_as_file", "bytes_random", "text_file",
                   "safetensors_header_len_exceeds_file", "safetensors_overlapping_offsets",
                   "safetensors_offsets_out_of_range", "safetensors_unknown_dtype", "safetensors_non_utf8_header",
                   "tokenizer_checkpoint_as_tokenizer", "tokenizer_random_tokenizer_json", "tokenizer_json_not_a_tokenizer",
                   "hf_index_missing_shard", "hf_trainer_state_without_optimizer", "deflate_compressed_record",
                   "duplicate_member_names", "torchscript_archive", "memo_dag_list_60", "crc_mismatch_flipped_byte",
                   "record_shorter_than_storage"):
        assert any(n.startswith(needle) for n in names), needle
    assert len(cases) >= 100


def test_no_code_executed(corpus, batch):
    root, cases, _ = corpus
    assert any(c.evil for c in cases)
    assert not list(root.rglob(mc.SENTINEL_NAME)), "a payload ran: the sentinel file exists"


def test_exit_codes_and_error_lines(corpus, batch):
    _, cases, _ = corpus
    problems = []
    for case, mode, r in _runs(cases, batch):
        code, match, codes = case.expectation(mode)
        label = f"{case.name} [{' '.join(mode) or 'plain'}]"
        err = r["stderr"]
        if r["code"] != code:
            problems.append(f"{label}: exit {r['code']}, expected {code}: {err.strip()[:300]!r}")
            continue
        if code == 2:
            if not (err.startswith("ckptfix: error: ") and err.endswith("\n") and err.count("\n") == 1):
                problems.append(f"{label}: stderr is not one 'ckptfix: error:' line: {err[:300]!r}")
            elif not re.search(match, err):
                problems.append(f"{label}: error line does not match {match!r}: {err.strip()[:300]!r}")
            if "--json" in mode:  # issue 18: the same error as a JSON object on stdout, the stderr line kept
                problems += _json_error_problems(label, r)
            elif r["stdout"]:
                problems.append(f"{label}: stdout not empty on error: {r['stdout'][:200]!r}")
        else:
            if err:
                problems.append(f"{label}: stderr not empty: {err[:300]!r}")
            missing = [c for c in codes if c not in r["stdout"]]
            if missing:
                problems.append(f"{label}: findings {missing} not reported")
    _fail(problems)


def test_never_a_traceback_or_internal_error(corpus, batch):
    _, cases, _ = corpus
    problems = [f"{c.name} [{' '.join(m)}]: {r['code']}: {(r['stderr'] + r['stdout'])[:300]!r}"
                for c, m, r in _runs(cases, batch)
                if "Traceback" in r["stdout"] + r["stderr"] or "internal error" in r["stderr"]
                or r["code"] in (3, "hang", "died") or str(r["code"]).startswith("escaped")]
    _fail(problems)


def test_error_lines_hold_no_terminal_escapes(corpus, batch):
    _, cases, _ = corpus
    _fail([f"{c.name} [{' '.join(m)}]: {r['stderr'][:200]!r}" for c, m, r in _runs(cases, batch)
           if CONTROL.search(r["stderr"])])


def test_json_output_is_valid(corpus, batch):
    _, cases, _ = corpus
    problems = []
    for case, mode, r in _runs(cases, batch):
        if "--json" in mode and r["code"] in (0, 1):
            try:
                data = json.loads(r["stdout"])
            except ValueError as exc:
                problems.append(f"{case.name} [{' '.join(mode)}]: invalid JSON ({exc})")
                continue
            if data.get("schema") != "ckptfix.inspect/1" or (data["summary"]["error"] > 0) != (r["code"] == 1):
                problems.append(f"{case.name} [{' '.join(mode)}]: schema/summary disagree with the exit code")
    _fail(problems)


def test_inputs_unchanged_and_nothing_written(batch):
    before, after = batch["before"], batch["after"]
    assert set(after) == set(before), f"files appeared/vanished: {sorted(set(after) ^ set(before))[:20]}"
    changed = [k for k in before if before[k] != after[k]]
    assert not changed, f"inputs modified: {changed[:20]}"


def test_no_run_hangs(batch):
    """Every CLI run ended within run_batch's per-run timeout (a wall-clock total is bench/'s to measure)."""
    hung = [r["id"] for r in batch["results"].values() if r["code"] == "hang"]
    assert not hung, f"{len(hung)} of {len(batch['jobs'])} CLI runs hung: {hung[:10]}"


# ----------------------------------------------------------------------------------------------------
# True one-process-per-input runs.


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    env.pop("CKPTFIX_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "ckptfix.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=60)


def test_evil_pickle_in_its_own_process(corpus):
    root, cases, workdir = corpus
    case = next(c for c in cases if c.name == "torch_save_nested_os_system")
    before = mc.snapshot(root)
    r = _cli("inspect", str(case.path), cwd=workdir)
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.startswith("ckptfix: error: ") and r.stderr.count("\n") == 1
    assert "refusing to unpickle" in r.stderr and "posix.system" in r.stderr
    r = _cli("inspect", str(case.path), "--trust-pickle", "--json", cwd=workdir)
    assert r.returncode == 1, r.stderr  # CKF706: the call it would make, an error finding
    assert json.loads(r.stdout)["extras"]["extra"] == {"x": [{"object": "posix.system"}]}
    assert mc.snapshot(root) == before
    assert not list(root.rglob(mc.SENTINEL_NAME))


def test_crc_mismatch_in_its_own_process(corpus):
    root, cases, workdir = corpus
    case = next(c for c in cases if c.name == "crc_mismatch_flipped_byte")
    r = _cli("inspect", str(case.path), cwd=workdir)
    assert r.returncode == 0 and r.stderr == ""  # nothing reads record bytes without --verify
    r = _cli("inspect", str(case.path), "--verify", "--json", cwd=workdir)
    assert r.returncode == 1, r.stderr
    findings = json.loads(r.stdout)["findings"]
    crc = [f for f in findings if f["code"] == "CKF703"]
    assert crc and crc[0]["tensors"] and all(t.startswith("data/") for t in crc[0]["tensors"])


# ----------------------------------------------------------------------------------------------------
# --trust-pickle and the allowlist, in-process.


def test_trust_pickle_builds_inert_records_only(corpus):
    from ckptfix import inspect
    from ckptfix.formats.pickle_records import OpaqueObject

    root, cases, _ = corpus
    evil = [c for c in cases if c.evil and c.trusted == ("findings", "") and c.path.is_file()]
    assert len(evil) >= 8
    for case in evil:
        report = inspect(case.path, trust_pickle=True)
        objects = report.ckpt.extras["extra"]["x"]
        assert len(objects) == 1 and isinstance(objects[0], OpaqueObject), case.name
        assert objects[0].cls.rsplit(".", 1)[-1] in ("system", "Popen", "eval", "exec", "_load_from_bytes"), case.name
    assert not list(root.rglob(mc.SENTINEL_NAME))


def test_allowlisted_stand_ins_cannot_be_poisoned(corpus):
    """BUILD on a shared stand-in (FloatStorage, torch.float32, a rebuild function) would change every
    later load in the process (a long-running guard, a batch): it must be refused and change nothing."""
    from ckptfix import inspect
    from ckptfix.errors import CkptfixError
    from ckptfix.formats import pickle_safe

    _, cases, _ = corpus
    snapshot = {k: repr(v) for k, v in pickle_safe.ALLOWED_GLOBALS.items()}
    storage = pickle_safe.ALLOWED_GLOBALS[("torch", "FloatStorage")]
    for name in ("build_on_allowlisted_storage_type", "build_on_allowlisted_dtype", "build_on_allowlisted_function",
                 "build_rewrites_tensor_record", "build_shadows_dict_method"):
        case = next(c for c in cases if c.name == name)
        with pytest.raises(CkptfixError):
            inspect(case.path)
    assert {k: repr(v) for k, v in pickle_safe.ALLOWED_GLOBALS.items()} == snapshot
    assert storage.dtype == "float32" and pickle_safe._rebuild_tensor.__defaults__ == (False, None, None)
    good = next(c for c in cases if c.name == "good_checkpoint")
    assert {t.dtype for t in inspect(good.path).ckpt.model.values()} == {"float32"}


# ----------------------------------------------------------------------------------------------------
# The corpus is armed: the same payloads do run under pickle / torch.load(weights_only=False).


ARMED = r"""
import io, os, pickle, sys, time, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, sys.argv[1])
import torch, malicious_corpus as mc
root = sys.argv[2]
for name in mc.payloads("x"):
    s1, s2 = os.path.join(root, f"pickle-{name}"), os.path.join(root, f"torch-{name}")
    try:
        pickle.loads(pickle.dumps(mc.payloads(s1)[name], protocol=2))
    except Exception:
        pass
    buf = io.BytesIO()
    torch.save({"model": {}, "x": [mc.payloads(s2)[name]]}, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=False)
    except Exception:
        pass
s3 = os.path.join(root, "inst")
try:
    pickle.loads(mc.inst_payload(s3))
except Exception:
    pass
deadline = time.time() + 10  # Popen's child runs asynchronously
names = [f"{k}-{n}" for k in ("pickle", "torch") for n in mc.payloads("x")] + ["inst"]
while time.time() < deadline and not all(os.path.exists(os.path.join(root, n)) for n in names):
    time.sleep(0.05)
print(sorted(n for n in names if not os.path.exists(os.path.join(root, n))))
"""


def test_corpus_payloads_are_live(tmp_path):
    """Proof the corpus is dangerous: unpickled by pickle or torch.load(weights_only=False), each payload
    creates its sentinel (in a throwaway process and folder). ckptfix never lets one run."""
    r = subprocess.run([sys.executable, "-c", ARMED, str(Path(__file__).parent), str(tmp_path)],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", f"payloads that did not run: {r.stdout}"


# ----------------------------------------------------------------------------------------------------
# What torch 2.x itself does (SECURITY.md quotes these).


def _torch_load(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(path, weights_only=True, **kw)


def _case(corpus, name):
    return next(c for c in corpus[1] if c.name == name).path


def test_torch_loads_a_flipped_byte_silently(corpus):
    good = _torch_load(_case(corpus, "good_checkpoint"))["model"]
    for mmap in (False, True):
        bad = _torch_load(_case(corpus, "crc_mismatch_flipped_byte"), mmap=mmap)["model"]
        differ = [k for k in good if not torch.equal(good[k], bad[k])]
        assert len(differ) == 1  # one tensor silently differs in its last mantissa bit; no error, no warning
        a, b = good[differ[0]].flatten(), bad[differ[0]].flatten()
        assert int((a != b).sum()) == 1 and torch.allclose(a, b)


def test_torch_mmap_does_not_notice_a_short_record(corpus):
    path = _case(corpus, "record_shorter_than_storage")
    with pytest.raises(RuntimeError, match="record size .* does not match expected size"):
        _torch_load(path)
    good = _torch_load(_case(corpus, "good_checkpoint"))["model"]
    bad = _torch_load(path, mmap=True)["model"]  # loads: the tensor's tail is whatever follows the record
    assert [k for k in good if not torch.equal(good[k], bad[k])]


def test_torch_on_files_that_are_not_checkpoints(corpus):
    with pytest.raises(EOFError) as exc:
        _torch_load(_case(corpus, "zero_byte_file"))
    assert str(exc.value) == ""  # an empty message
    with pytest.raises(KeyError):  # the text is read as pickle opcodes: 'h' = BINGET of memo 101 ('e')
        _torch_load(_case(corpus, "text_file"))
    with pytest.raises(OSError):  # "[Errno 22] Invalid argument": nothing says "truncated"
        _torch_load(_case(corpus, "truncated_zip_in_central_dir"))
    with pytest.raises(RuntimeError, match="TorchScript"):
        _torch_load(_case(corpus, "torchscript_archive"))
    with pytest.raises(RuntimeError, match="not in a subdirectory"):
        _torch_load(_case(corpus, "zip_path_traversal_members"))


def _tensors(tree, prefix=""):
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(v, f"{prefix}.{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _tensors(v, f"{prefix}.{i}")


def test_torch_duplicate_members_which_copy_depends_on_layout(corpus, tmp_path):
    """Which copy of a duplicated record torch.load reads depends on the archive layout (miniz sorts the
    names and binary-searches them), not simply "the last one": measured here by adding a zeroed copy of
    each record in turn. So ckptfix cannot know which bytes torch will use: it reports CKF702, and
    refuses a duplicated data.pkl outright."""
    good_path = _case(corpus, "good_checkpoint")
    good = dict(_tensors(_torch_load(good_path)))
    members = mc.zip_members(good_path)
    read_zeros = []
    for name in [n for n, _ in members if "/data/" in n][:12]:
        zeros = bytes(len(dict(members)[name]))
        mc.write_zip(tmp_path / "dup.pth", members + [(name, zeros)])
        loaded = dict(_tensors(_torch_load(tmp_path / "dup.pth")))
        read_zeros.append(any(not torch.equal(good[k], loaded[k]) for k in good))
    assert any(read_zeros) and not all(read_zeros), read_zeros  # sometimes the first copy, sometimes the last
    # Two data.pkl, the evil one first: torch happens to read the benign one.
    assert set(_torch_load(_case(corpus, "duplicate_data_pkl_evil_first"))) >= {"model", "optimizer"}


def test_torch_inflates_a_compressed_record(corpus):
    path = _case(corpus, "deflate_compressed_record_64MiB")
    assert path.stat().st_size < 1 << 20
    assert _torch_load(path)["w"].numel() == 1 << 24  # 64 MiB inflated from a file under 1 MiB


def test_torch_loads_lying_central_directory_with_mmap(corpus):
    for name in ("zip_central_dir_size_bigger", "zip_central_dir_size_smaller"):
        with pytest.raises(RuntimeError, match="record size"):
            _torch_load(_case(corpus, name))
        _torch_load(_case(corpus, name), mmap=True)  # no error


def _load_in_subprocess(path: Path, loader: str, timeout: float) -> int | str:
    code = {"pickle": "import pickle; pickle.load(open(p, 'rb'))",
            "torch": "import torch; torch.load(p, weights_only=True)"}[loader]
    try:
        return subprocess.run([sys.executable, "-c", f"p = {str(path)!r}; {code}"], capture_output=True,
                              timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return "timeout"


def test_torch_and_pickle_hang_or_crash_on_tuple_bombs(tmp_path):
    """A 2 KB tuple DAG used as a dict key: pickle.load and torch.load(weights_only=True) hash it in
    2**40 steps; a 300 KB tuple nested 300k deep as a key kills both with SIGSEGV. ckptfix refuses both."""
    dag = tmp_path / "dag.pkl"
    dag.write_bytes(mc.tuple_dag_key_pickle(40))
    deep = tmp_path / "deep.pkl"
    deep.write_bytes(mc.deep_tuple_key_pickle(300_000))
    assert _load_in_subprocess(dag, "pickle", 4) == "timeout"
    assert _load_in_subprocess(dag, "torch", 6) == "timeout"
    assert _load_in_subprocess(deep, "pickle", 30) == -11
    assert _load_in_subprocess(deep, "torch", 30) == -11
    small = tmp_path / "small.pkl"
    small.write_bytes(mc.tuple_dag_key_pickle(16))  # the same shape, small: loads fine
    assert _load_in_subprocess(small, "pickle", 30) == 0
    from ckptfix.errors import UnreadableCheckpoint
    from ckptfix.formats.pickle_safe import load_pickle

    for path, why in ((dag, "memo bomb"), (deep, "nested more than 100 deep")):
        # the refusal names its counted guard (shared references / depth), so the load never expanded the DAG
        with pytest.raises(UnreadableCheckpoint, match=why):
            load_pickle(path.read_bytes(), str(path))
    assert load_pickle(small.read_bytes(), "small")  # legitimate sharing is fine


def test_torch_weights_only_refuses_the_payloads(corpus):
    root, cases, _ = corpus
    for case in cases:
        if case.evil and case.name.startswith(("raw_pickle_", "torch_save_nested_")):
            with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
                _torch_load(case.path)
    assert not list(root.rglob(mc.SENTINEL_NAME))
