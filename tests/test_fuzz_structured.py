"""A bounded slice of the structure-aware fuzzer (`tests/fuzz_structured.py`) in the default suite.

Every format's mutators run on a fixed number of inputs (the same sequence everywhere) from real seed files (DeepSpeed's engine run is left to the
long run: here its mutator falls back to the torch tree one), in this process, with the fuzzer's own
checks: exit code 0/1/2, no traceback, at most 5 s of CPU per run, peak memory, input unchanged, no stray file.
The long run (>= 10^5 inputs per format where time allows) is `python tests/fuzz_structured.py FORMAT N`.
"""

from __future__ import annotations

import time

import fuzz_structured as fz
import pytest

#: A fixed count, not a time budget: CI must run the very inputs that ran here, however fast its machine.
INPUTS_PER_FORMAT = 60
#: Only a safety net against a slow machine (it can only shorten the same sequence).
MAX_SECONDS_PER_FORMAT = 60.0


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return fz.make_seeds(tmp_path_factory.mktemp("fuzz_seeds"), deepspeed=False)


@pytest.mark.parametrize("fmt", fz.FORMATS)
def test_fuzz_slice(seeds, tmp_path, fmt, monkeypatch):
    # the 10^5-entry inputs of `grammar_many` cost seconds each: here at 10^3-10^4 (their structure), 10^5+ in the long run
    monkeypatch.setattr(fz, "MANY", fz.FEW)
    until = time.time() + MAX_SECONDS_PER_FORMAT
    inputs, runs, failures = fz.run(fmt, INPUTS_PER_FORMAT, seed=1, seeds=seeds, scratch=tmp_path, until=until)
    assert inputs >= 1 and runs >= inputs
    shown = [{k: f.get(k) for k in ("problems", "argv", "code", "stderr")} for f in failures if "problems" in f]
    assert not shown, shown
