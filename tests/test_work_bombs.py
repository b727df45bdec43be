"""Pickles that ask the unpickler for work out of proportion to their size: refused before any
of it is done (``distckpt.integrity.work_scan.refuse_work_bombs``), wherever distckpt unpickles
(``.metadata``, value records, tensor records, ``distckpt import``); and a decoder that walks a
shared structure once."""

from __future__ import annotations

import io
import pickle
import random
import re
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from distckpt.errors import UnsafeCheckpointError
from distckpt.integrity import pickle_scan, work_scan
from distckpt.integrity.pickle_scan import WORK_BASE, WORK_PER_BYTE, refuse_work_bombs
from distckpt.state.decoding import decode_loaded

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import forge  # noqa: E402
import work_bomb_job  # noqa: E402


@pytest.mark.timeout(300)
def test_forged_work_bombs_are_refused_by_name_everywhere_they_are_read(tmp_path):
    """Before, five of the seven forged reads never returned (a 2.8 KB ``.metadata``, 714-byte
    value and tensor records, a 1 KB list of lists), one took ~100 MB from 51 KB before
    failing, and one loaded 64 MiB of tensors from a 1 MiB record (zip entries sharing bytes);
    now each ends in a named refusal, or loads. A fresh interpreter under a
    timeout: a regression is a process that never returns, holding the GIL."""
    got = forge.run_cases(HERE / "work_bomb_job.py", tmp_path)
    scan = "pickle would hash, compare or copy more than"
    expected = {
        "metadata-dag-key": ".metadata: unpickling its",
        "value-dag-key": "checkpoint value 'extra'",
        "value-ordered-dicts": "checkpoint value 'extra'",
        "tensor-dag-key": "item 'model.0.weight'",
    }
    for case, words in expected.items():
        assert got[case]["error"] == "UnsafeCheckpointError" and words in got[case]["message"], got[case]
        assert scan in got[case]["message"], got[case]
    for case in ("verify-metadata-dag-key", "verify-value-dag-key", "verify-tensor-dag-key"):
        assert got[case]["code"] == 1 and scan in got[case]["stderr"], got[case]
    for case in ("value-overlapping-entries", "verify-value-overlapping-entries"):
        text = got[case].get("message", "") + got[case].get("stderr", "")
        assert "zip entries hold 67,1" in text and "more than its 1,0" in text, got[case]
    # Nothing hashes a list of lists: it is read (then refused by the value's digest, as forged).
    assert got["value-dag-list"]["error"] == "IntegrityError" and "sha256" in got["value-dag-list"]["message"], got


def test_the_decoder_walks_a_shared_structure_once():
    nested: list = [1]
    for _ in range(60):
        nested = [nested, nested]
    out = decode_loaded({"x": nested}, "k")
    assert out["x"] is nested and out["x"][0] is out["x"][1]


class Counted:
    """A leaf that counts how often it is hashed (what the scan's work bounds)."""

    hashes = 0

    def __init__(self, i: int) -> None:
        self.i = i

    def __hash__(self) -> int:
        Counted.hashes += 1
        return self.i

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Counted) and other.i == self.i

    def __reduce__(self):
        return (Counted, (self.i,))


def _random_graph(rng: random.Random, steps: int) -> list:
    """Objects built from earlier ones (shared, as a pickle's memo shares them): tuples, lists,
    dicts, sets and frozensets, hashable ones as keys and members."""
    hashable: list = [Counted(i) for i in range(3)] + [7, "s"]
    pool: list = list(hashable)

    def key() -> object:  # mostly one of the newest: chains of tuples holding tuples
        return hashable[-rng.randint(1, 3)] if rng.random() < 0.7 else rng.choice(hashable)

    for _ in range(steps):
        kind = rng.choice(["tuple", "tuple", "tuple", "list", "dict", "frozenset", "set"])
        k = rng.randint(0, 3)
        if kind == "tuple":
            obj = tuple(key() for _ in range(k))
            hashable.append(obj)
        elif kind == "frozenset":
            obj = frozenset(key() for _ in range(k))
            hashable.append(obj)
        elif kind == "list":
            obj = [rng.choice(pool) for _ in range(k)]
        elif kind == "set":
            obj = {key() for _ in range(k)}
        else:
            obj = {key(): rng.choice(pool) for _ in range(k)}
        pool.append(obj)
    return pool


def test_the_scan_bounds_the_hashing_it_lets_through(monkeypatch):
    """Seeded random object graphs with sharing, in every protocol: where the scan lets a pickle
    through, unpickling it hashes the leaves at most as often as the scan's work says. (A budget
    scaled down to these small graphs, so that both outcomes occur.)"""
    monkeypatch.setattr(work_scan, "WORK_PER_BYTE", 1)
    monkeypatch.setattr(work_scan, "WORK_BASE", 256)
    outcomes = {"refused": 0, "read": 0}
    for seed in range(12):
        rng = random.Random(seed)
        for _ in range(20):
            graph = _random_graph(rng, rng.randint(1, 50))
            data = pickle.dumps(graph, protocol=rng.randint(0, pickle.HIGHEST_PROTOCOL))
            try:
                work = refuse_work_bombs(data, "x")
            except UnsafeCheckpointError:
                outcomes["refused"] += 1
                continue
            outcomes["read"] += 1
            Counted.hashes = 0
            pickle.loads(data)
            assert Counted.hashes <= work, (seed, Counted.hashes, work)
    assert min(outcomes.values()) >= 10, outcomes


def test_growth_after_a_tuple_took_an_object_is_bounded():
    # Legitimate: a dict holding a tuple that holds the dict (what pickle writes for a cycle).
    d: dict = {}
    d["self"] = (d,)
    refuse_work_bombs(pickle.dumps(d, protocol=2), "x")
    # Crafted: a dict put in a tuple, then given 100 items (hashing the tuple would visit them,
    # while its weight was fixed when it was built).
    crafted = b"\x80\x02}q\x00h\x00\x85q\x010(" + b"".join(b"K%cN" % i for i in range(100)) + b"uh\x01."
    assert pickle.loads(crafted)[0] == {i: None for i in range(100)}
    with pytest.raises(UnsafeCheckpointError, match="adds 200 objects .* to an object after a tuple took it"):
        refuse_work_bombs(crafted, "x")


def test_what_dcp_and_torch_save_write_asks_little_work(tmp_path):
    """Far from the budget (:data:`WORK_PER_BYTE` a byte): a ``.metadata`` of many chunks, and
    value records of what optimizers, schedulers and users keep."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(20)])
    dcp.save({"model": model.state_dict(), "extra": {"epoch": 3, "lrs": [0.1] * 50}}, checkpoint_id=tmp_path / "c")
    data = (tmp_path / "c" / ".metadata").read_bytes()
    assert refuse_work_bombs(data, "x") <= 2 * len(data)
    for value in ({"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8}, [torch.zeros(3), {"a": (1, 2, 3)}], {"step": 5, "b": [0.1] * 100},
                  ("marker", "kind", ((1, 2), frozenset({3}))), list(range(1000))):  # fmt: skip
        buf = io.BytesIO()
        torch.save(value, buf)
        with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
            pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
        assert refuse_work_bombs(pkl, "x") <= 2 * len(pkl) + 16, value
    # One long key shared by 3,000 dicts (a key's hash is cached, but the walk weighs a string
    # by its length at each reference): within the budget, by a margin (refused at first).
    buf = io.BytesIO()
    torch.save([{"metric/" + "x" * 3000: float(i)} for i in range(3000)], buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    assert refuse_work_bombs(pkl, "x") <= WORK_PER_BYTE * len(pkl) / 4
    assert WORK_PER_BYTE >= 8 and WORK_BASE >= 1 << 12  # the margin those figures rely on


def test_a_forty_level_shared_tuple_is_refused_in_every_unpickler_input():
    c_pickle = b"\x80\x02}" + work_bomb_job.dag_tuple(0) + b"Ns."
    for data in (c_pickle, work_bomb_job.dag_key_pickle(), work_bomb_job.ordered_dicts_pickle()):
        with pytest.raises(UnsafeCheckpointError, match="would hash, compare or copy more than"):
            refuse_work_bombs(data, "x")
    # Ten levels are harmless (2**10 visits): the budget lets them through.
    assert refuse_work_bombs(b"\x80\x02}" + work_bomb_job.dag_tuple(0, levels=10) + b"Ns.", "x") < WORK_BASE


def test_the_scan_ends_quietly_where_the_unpickler_fails():
    for data in (b"", b"\x80\x02", b"\x80\x02t.", b"\x80\x02h\x05.", b"\x80\x02\xff", b"\x80\x02X\xff\xff\xff\xff", b"0", b"s", b"u",
                 b"j\x00", b"\x80\x02]j\x00\x00"):  # fmt: skip
        assert refuse_work_bombs(data, "x") >= 0
    rng = random.Random(5)
    base = pickle.dumps({"a": [(1, 2), frozenset({3})], "b": {4: (5,)}}, protocol=2)
    for _ in range(2000):  # random damage: never an exception other than a refusal
        data = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            refuse_work_bombs(bytes(data), "x")
        except UnsafeCheckpointError:
            pass
    assert pickle_scan.GROWTH_AFTER_CAPTURE >= 16


def test_distckpt_import_refuses_a_work_bomb_and_still_imports_a_plain_file(tmp_path):
    from distckpt.tools.importer import import_torch_save

    bomb = tmp_path / "bomb.pt"
    bomb.write_bytes(work_bomb_job._record(work_bomb_job.dag_key_pickle()))
    with pytest.raises(UnsafeCheckpointError, match=r"bomb.pt: unpickling its 714-byte pickle would hash, compare or copy"):
        import_torch_save(str(bomb), str(tmp_path / "out"))
    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.arange(4.0)}, plain)
    import_torch_save(str(plain), str(tmp_path / "out2"))
    assert (tmp_path / "out2").is_dir()


def test_a_zip_whose_entries_share_bytes_is_refused_with_or_without_torchs_size_lookup():
    from distckpt.integrity import deep_stack

    forged = work_bomb_job.overlapping_record(tensors=8, floats=1 << 10)
    assert len(torch.load(io.BytesIO(forged), weights_only=True)) == 8  # torch reads it: 8 storages
    with pytest.raises(UnsafeCheckpointError, match=r"v: its 14 zip entries hold 3[\d,]+ bytes, more than its"):
        deep_stack.torch_load(io.BytesIO(forged), forged, "v")

    class OldReader:  # torch 2.11's: no get_record_size
        def __init__(self, record):
            self.real = torch._C.PyTorchFileReader(record)

        def get_all_records(self):
            return self.real.get_all_records()

    names = OldReader(io.BytesIO(forged)).get_all_records()
    with zipfile.ZipFile(io.BytesIO(forged)) as z:
        directory = sum(info.file_size for info in z.infolist())
    for reader in (OldReader(io.BytesIO(forged)), torch._C.PyTorchFileReader(io.BytesIO(forged))):
        assert deep_stack._held(reader, names, io.BytesIO(forged)) == directory > len(forged)
    honest = io.BytesIO()
    torch.save([torch.zeros(1 << 10) for _ in range(8)], honest)
    assert len(deep_stack.torch_load(io.BytesIO(honest.getvalue()))) == 8


def _shared_tuple(levels: int) -> tuple:
    t: tuple = (None,)
    for _ in range(levels):
        t = (t, t)
    return t


def _shared_list(levels: int) -> list:
    t: list = [None]
    for _ in range(levels):
        t = [t, t]
    return t


def test_the_decoder_bounds_what_it_hashes_and_what_it_shows():
    """What the unpickler never hashed, the decoder's own set(), frozenset() and dict rebuilds
    would: bounded (before, each case below never returned, nor did a message showing one)."""
    from distckpt.errors import IntegrityError
    from distckpt.state.encoded import MARKER

    for kind in ("set", "frozenset"):
        with pytest.raises(IntegrityError, match="unfold into more than 4,000,000 objects to hash"):
            decode_loaded((MARKER, kind, (_shared_tuple(40),)), "k")
    # Frozensets cache their hashes, but two equal ones compare all they hold: two equal,
    # distinct chains of frozensets of pairs of the previous one.
    f = g = frozenset({0})
    for _ in range(40):
        f, g = frozenset({(f, 0), (f, 1)}), frozenset({(g, 0), (g, 1)})
    with pytest.raises(IntegrityError, match="unfold into more than"):
        decode_loaded((MARKER, "set", (f, g)), "k")
    with pytest.raises(IntegrityError, match="unfold into more than"):  # a dict rebuilt: its keys hashed again
        decode_loaded({f: (MARKER, "set", ())}, "k")
    # Messages show a value bounded (a date's payload a list holding one list twice, 40 deep).
    with pytest.raises(IntegrityError, match=r"date \[\[\[") as info:
        decode_loaded((MARKER, "date", _shared_list(40)), "k")
    assert len(str(info.value)) < 400
    # A legitimate set of pairs decodes.
    assert decode_loaded((MARKER, "set", tuple((i, str(i)) for i in range(10_000))), "k") == {(i, str(i)) for i in range(10_000)}


def test_an_array_whose_data_repeats_its_storage_is_refused():
    from distckpt.errors import IntegrityError
    from distckpt.state.encoded import MARKER

    repeated = torch.zeros(1, dtype=torch.float64).expand(100_000_000)  # 8 bytes of storage
    with pytest.raises(IntegrityError, match="repeats a storage of 8 bytes"):
        decode_loaded((MARKER, "numpy.ndarray", ("<f8", (100_000_000,), repeated)), "k")
    ok = decode_loaded((MARKER, "numpy.ndarray", ("<f8", (3,), torch.arange(3, dtype=torch.float64))), "k")
    assert ok.tolist() == [0.0, 1.0, 2.0]


def test_shown_is_bounded_for_shared_and_odd_values():
    from distckpt._shown import shown

    assert len(shown(_shared_list(60))) <= 120 and shown(_shared_tuple(60)).startswith("((")

    class Loud:
        def __repr__(self):
            raise RuntimeError("no")

    assert shown(Loud()) == "<Loud>" and shown([1, "a", 2.5]) == "[1, 'a', 2.5]" and shown("x" * 500, 20) == repr("x" * 500)[:20]


def test_metadata_sizes_are_integers_a_tensor_can_have():
    """A size of a hundred references to one 6 KB integer made the coverage check's products
    take ~12 s (and its message fail on Python's digit limit); a thousand dims of 2**63 - 1
    made the element count unprintable: both are named."""
    import pickletools
    import struct as st

    from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata

    from distckpt.errors import IntegrityError
    from distckpt.integrity.metadata_check import validate_metadata
    from distckpt.integrity.safe_pickle import load_metadata

    def with_size(size: object) -> bytes:
        entry = TensorStorageMetadata(TensorProperties(dtype=torch.float32), size, [])  # type: ignore[arg-type]
        return pickle.dumps(Metadata(state_dict_metadata={"w": entry}, storage_data={}), protocol=2)

    mark = "SIZE-GOES-HERE"
    data = with_size(mark)
    slot = 1 + max(a for op, a, _ in pickletools.genops(data) if op.name in ("BINPUT", "LONG_BINPUT"))
    big = (1 << (8 * 6000 - 3)).to_bytes(6000, "little")
    refs = b"](\x8b" + st.pack("<i", 6000) + big + b"r" + st.pack("<I", slot) + (b"j" + st.pack("<I", slot)) * 99 + b"e"
    data = data.replace(b"X" + st.pack("<I", len(mark)) + mark.encode(), refs)
    with pytest.raises(IntegrityError, match="tensor 'w': size .* is malformed"):
        validate_metadata(load_metadata(data, "x"), "x")
    with pytest.raises(IntegrityError, match=r"tensor 'w': size .* holds 2\*\*63 elements or more"):
        validate_metadata(load_metadata(with_size(torch.Size([(1 << 63) - 1] * 1000)), "x"), "x")


def test_chunk_coverage_is_checked_along_the_best_dimension_and_bounded():
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as Chunk

    from distckpt.errors import IntegrityError
    from distckpt.integrity.metadata_check import MAX_CHUNK_COMPARISONS, _check_coverage

    # Column shards of a (4, 20000) tensor: every chunk spans all rows (swept along dim 0, they
    # were all compared with each other: minutes); along dim 1, none overlap.
    cols = [Chunk(offsets=torch.Size([0, i]), sizes=torch.Size([4, 1])) for i in range(20_000)]
    _check_coverage("w", (4, 20_000), cols, "x")
    with pytest.raises(IntegrityError, match=r"chunks at \[0, 7\] and \[0, 7\] overlap"):
        _check_coverage("w", (4, 20_001), cols + [Chunk(offsets=torch.Size([0, 7]), sizes=torch.Size([4, 1]))], "x")
    # Unit chunks of a (2,) * 14 tensor overlap along every dimension in half their pairs.
    grid = [Chunk(offsets=torch.Size([(n >> d) & 1 for d in range(14)]), sizes=torch.Size([1] * 14)) for n in range(1 << 14)]
    with pytest.raises(IntegrityError, match=f"16,384 chunks overlap along every dimension in more than {MAX_CHUNK_COMPARISONS:,}"):
        _check_coverage("w", (2,) * 14, grid, "x")


@pytest.mark.parametrize(
    "pkl, refused",
    [
        (b"\x80\x02c__builtin__\nbytearray\nJ\x00\x00\x00\x30\x85R.", "__builtin__.bytearray with (int)"),  # 800 MB from 30 bytes
        (b"\x80\x02c_codecs\nencode\nX\x03\x00\x00\x00\xc3\xa9aX\x08\x00\x00\x00punycode\x86R.", "_codecs.encode with (str, str)"),
        (b"\x80\x02ctorch._utils\n_rebuild_device_tensor_from_cpu_tensor\nN\x85R.", "_rebuild_device_tensor_from_cpu_tensor a call"),
    ],
)
def test_calls_whose_cost_their_arguments_choose_are_refused(pkl, refused):
    from distckpt.integrity import deep_stack

    record = work_bomb_job._record(pkl)
    with pytest.raises(UnsafeCheckpointError, match=f"v: its pickle calls .*{re.escape(refused)}"):
        deep_stack.torch_load(io.BytesIO(record), record, "v")


def test_bytes_and_bytearrays_as_torch_save_writes_them_still_load():
    from distckpt.integrity import deep_stack

    for value in (b"xy\x80", bytearray(b"ab\xff"), bytearray(), [b"a", bytearray(b"b"), {"k": b"\x00" * 1000}]):
        buf = io.BytesIO()
        torch.save(value, buf)
        assert deep_stack.torch_load(io.BytesIO(buf.getvalue())) == value
