"""The multipart plan of `ckptfix.publish` (no server needed): a staged file mixing ranges copied from source
objects and new bytes becomes parts S3 accepts, covering the file in order, byte for byte."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfix.publish import MAX_COPY_PART, MIN_PART, Copy, _parts, _segments, switch_last

MB = 1 << 20


def _check(size: int, copies: list[Copy]) -> list:
    parts = _parts(_segments(size, copies))
    pos = 0
    for i, part in enumerate(parts):
        length = sum(piece[2] for piece in part)
        if i < len(parts) - 1:
            assert length >= MIN_PART, (i, length)  # S3: every part but the last
        if part[0][0] == "copy":
            assert len(part) == 1 and MIN_PART <= length <= MAX_COPY_PART
        for piece in part:
            assert piece[1] == pos, (piece, pos)  # in order, no gap, no overlap
            if piece[0] in ("copy", "fetch"):
                copy = piece[3]
                assert copy.dst_pos <= piece[1] and piece[1] + piece[2] <= copy.dst_pos + copy.size
            pos += piece[2]
    assert pos == size
    return parts


def test_small_headers_between_large_records_borrow_from_the_next_copy():
    # a torch zip: a 100-byte header, a 20 MiB record, a 60-byte header, a 8 MiB record, the central directory
    copies = [Copy(100, "b/src", 0, 20 * MB), Copy(100 + 20 * MB + 60, "b/src", 30 * MB, 8 * MB)]
    parts = _check(100 + 20 * MB + 60 + 8 * MB + 2000, copies)
    kinds = [[p[0] for p in part] for part in parts]
    assert kinds[0] == ["staged", "fetch"] and kinds[1] == ["copy"]  # 5 MiB uploaded, the rest copied
    # the first record less what topped the header up to 5 MiB; the second's remaining 3 MiB are too few
    assert sum(p[2] for part in parts if part[0][0] == "copy" for p in part) == 20 * MB - (MIN_PART - 100)


def test_a_copy_larger_than_5_gib_is_split():
    parts = _check(12 << 30, [Copy(0, "b/src", 0, 12 << 30)])
    assert [p[0][0] for p in parts] == ["copy"] * 3


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12 * MB), st.integers(1, 40 * MB)), max_size=8), st.integers(0, 3 * MB))
def test_any_layout_gives_valid_parts(layout, tail):
    pos, copies = 0, []
    rng = random.Random(len(layout))
    for gap, size in layout:
        pos += gap
        copies.append(Copy(pos, "b/src", rng.randrange(0, 1 << 30), size))
        pos += size
    _check(pos + tail, copies)


def test_switch_objects_go_last_deepest_first():
    names = ["latest_checkpointed_iteration.txt", "iter_2/.metadata", "iter_2/__0_0.distcp", "iter_2/common.pt",
             "config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors", "ckptfix.json"]
    order = switch_last(names)
    assert order[:4] == ["ckptfix.json", "iter_2/__0_0.distcp", "iter_2/common.pt", "model-00001-of-00002.safetensors"]
    assert order[4] == "iter_2/.metadata" and set(order[5:]) == {"config.json", "latest_checkpointed_iteration.txt",
                                                                 "model.safetensors.index.json"}
