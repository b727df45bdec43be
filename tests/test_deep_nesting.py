"""Tuples nested hundreds of thousands of levels deep in a checkpoint's pickles (``.metadata``, value
records): a named error, never a crash of the interpreter (``distckpt.integrity.deep_stack``)."""

from __future__ import annotations

import io
import pickle
import random
import sys
import threading
from pathlib import Path

import pytest
import torch

from distckpt.errors import IntegrityError
from distckpt.integrity import deep_stack
from distckpt.integrity.metadata_check import MAX_TUPLE_NESTING, check_nesting

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import forge  # noqa: E402


def _chain(tuples: int) -> tuple:
    """``tuples`` tuples, each holding the next (the innermost empty)."""
    t: tuple = ()
    for _ in range(tuples - 1):
        t = (t,)
    return t


def test_forged_deep_nesting_is_refused_by_name_everywhere_it_is_read(tmp_path):
    """Each forged file (every checksum and digest re-sealed) crashed the reading process with
    SIGSEGV before (7 of the 8 cases; the eighth loaded a forged attribute silently); now the
    load and ``verify --state`` name the file and what is malformed."""
    got = forge.run_cases(HERE / "deep_nesting_job.py", tmp_path)
    # A storage_data key's offset is checked as the unpickler builds the key (it is hashed then).
    key = got["metadata-key-offset"]
    assert key["error"] == "UnsafeCheckpointError" and "gives a MetadataIndex the fqn str and offset tuple" in key["message"], key
    assert ".metadata" in key["message"], key
    expected = {
        "metadata-planner-data": "planner_data nests tuples more than 32 levels deep",
        "metadata-extra-attribute": "Metadata.extra nests tuples more than 32 levels deep",
        "metadata-entry-key": "state_dict_metadata key",
        "value-record": "checkpoint value 'extra'",
    }
    # 400,000 levels deflated into a 1.2 KB record: its entries hold more than the record.
    deflated = got["value-record-deflated"]
    assert deflated["error"] == "UnsafeCheckpointError" and "checkpoint value 'extra'" in deflated["message"], deflated
    assert "overlap or are compressed" in deflated["message"], deflated
    for case, words in expected.items():
        assert got[case]["error"] == "IntegrityError" and words in got[case]["message"], got[case]
    for case in expected:
        if case.startswith("metadata"):
            assert ".metadata" in got[case]["message"], got[case]
    assert got["verify-metadata"]["code"] == 1 and "offset tuple" in got["verify-metadata"]["stderr"], got
    assert got["verify-value-record"]["code"] == 1 and "value 'extra'" in got["verify-value-record"]["stderr"], got


def test_check_nesting_bounds_tuple_chains_wherever_they_are():
    check_nesting({"a": [_chain(MAX_TUPLE_NESTING)]}, "f", "x")
    for value in ({"a": _chain(MAX_TUPLE_NESTING + 1)}, [{_chain(40): 1}], {1, _chain(50)}, _chain(300_000)):
        with pytest.raises(IntegrityError, match=r"f: x nests tuples more than 32 levels deep"):
            check_nesting(value, "f", "x")
    # A chain first reached on a short path and then from deeper: still its full length.
    inner = _chain(20)
    outer = inner
    for _ in range(20):
        outer = (outer,)
    for order in ([inner, outer], [outer, inner]):
        with pytest.raises(IntegrityError):
            check_nesting(order, "f", "x")
    # Shared objects are walked once (2**100 paths), cycles end; lists break a chain (unhashable).
    shared: list = [1]
    for _ in range(100):
        shared = [shared, shared]
    looped: list = []
    looped.append(looped)
    looped.append((looped,))
    broken = _chain(30)
    for _ in range(10):
        broken = ([_chain(30), broken],)
    for value in (shared, looped, broken):
        check_nesting(value, "f", "x")


def _depth(value: object) -> int:
    return 1 + max((_depth(v) for v in value if isinstance(v, tuple)), default=0) if isinstance(value, tuple) else 0


def _random_value(rng: random.Random, budget: int) -> object:
    kind = rng.randrange(6)
    if budget <= 0 or kind == 0:
        return rng.choice([None, 1, 2**40, "s", b"b", 1.5, True])
    items = [_random_value(rng, budget - 1 - rng.randrange(3)) for _ in range(rng.randrange(4))]
    if kind in (1, 2, 3):
        return tuple(items)
    if kind == 4:
        return items
    return {str(i): v for i, v in enumerate(items)}


@pytest.mark.parametrize("seed", range(40))
def test_the_nesting_bound_holds_for_random_pickles(seed):
    """Seeded fuzz: the bound counted on the bytes is at least the tuples' real nesting, for every
    protocol DCP and torch.save use."""
    rng = random.Random(seed)
    value = tuple(_random_value(rng, 60) for _ in range(3))
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        assert deep_stack.tuple_nesting_bound(pickle.dumps(value, protocol=protocol)) >= _depth(value)


def test_a_records_bound_counts_its_pickle_not_its_tensor_bytes():
    """A torch.save record of 4 MiB of bytes that all read as TUPLE1 opcodes: counting the
    record would ask for a 768 MiB stack; its data.pkl holds a few tuples."""
    buf = io.BytesIO()
    torch.save({"t": torch.full((4 << 20,), 0x85, dtype=torch.uint8)}, buf)
    assert deep_stack.tuple_nesting_bound(buf.getvalue()) > 4 << 20
    assert deep_stack.record_nesting_bound(buf, buf.getbuffer()) < 50
    assert buf.tell() == 0
    assert torch.equal(deep_stack.torch_load(buf)["t"], torch.full((4 << 20,), 0x85, dtype=torch.uint8))
    # Not a zip (damaged, or torch's legacy format): every byte counted.
    odd = io.BytesIO(b"\x85" * 2000)
    assert deep_stack.record_nesting_bound(odd) == 2001 and odd.tell() == 0


def test_call_with_stack_returns_raises_and_stays_in_place_when_shallow():
    here = threading.get_ident()
    assert deep_stack.call_with_stack(10, threading.get_ident) == here
    assert deep_stack.call_with_stack(50_000, threading.get_ident) != here
    assert deep_stack.call_with_stack(50_000, lambda: hash(_chain(50_000))) == hash(_chain(50_000))
    with pytest.raises(KeyError, match="boom"):
        deep_stack.call_with_stack(50_000, lambda: {}["boom"])
    assert threading.stack_size() == 0  # restored


def test_a_stack_that_cannot_be_reserved_is_a_memory_error_naming_its_size(monkeypatch):
    def refuse(self) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(MemoryError, match=r"could not reserve a \d+ MiB thread stack .* 1,000,000 levels deep"):
        deep_stack.call_with_stack(1_000_000, lambda: None)
    assert threading.stack_size() == 0


def _deep_dict_pickle(levels: int) -> bytes:
    return b"\x80\x02}" + b")" + b"\x85" * levels + b"K\x01s."


def _zip_record(pkl: bytes, compression: int) -> bytes:
    """A torch.save record whose data.pkl is ``pkl``, its entries written with ``compression``."""
    import zipfile

    buf = io.BytesIO()
    torch.save({"k": 1}, buf)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zin, zipfile.ZipFile(out, "w", compression) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, pkl if info.filename.endswith("data.pkl") else zin.read(info.filename))
    return out.getvalue()


@pytest.mark.parametrize("levels", [5_000, 1_200_000])
def test_a_records_bound_follows_what_torch_load_reads(levels):
    """From an attacker's review: a deflated data.pkl (1.2 KB for 400,000 levels) counted 19; a
    legacy (non-zip) pickle with a zip appended counted the zip's. Small and large records."""
    import zipfile

    deep = _deep_dict_pickle(levels)
    deflated = _zip_record(deep, zipfile.ZIP_DEFLATED)
    assert len(deflated) < 20_000 or levels < 100_000
    polyglot = deep + _zip_record(pickle.dumps({"k": 1}), zipfile.ZIP_STORED)
    for record in (deflated, polyglot):
        assert deep_stack.record_nesting_bound(io.BytesIO(record), record) > levels
        assert deep_stack.record_nesting_bound(io.BytesIO(record)) > levels
    # What torch.save writes (stored entries) is still counted from the bytes, cheaply.
    plain = io.BytesIO()
    torch.save({"a": (1, (2, 3))}, plain)
    assert 3 <= deep_stack.record_nesting_bound(plain, plain.getbuffer()) < 100
