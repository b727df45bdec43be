"""Memory bombs in ``.metadata``: a pickle that declares memo slots or lengths its size cannot
hold. Before, the C unpickler took them at their word: eleven bytes with ``LONG_BINPUT
500,000,000`` cost 8 GiB and 8 s of a load (a larger index, an OOM kill) before any check ran.
Now :func:`distckpt.integrity.pickle_scan.refuse_memory_bombs` walks the opcodes first."""

from __future__ import annotations

import datetime
import os
import pickle
import pickletools
import random
import struct
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from distckpt.errors import UnsafeCheckpointError
from distckpt.integrity import safe_pickle
from distckpt.integrity.pickle_scan import refuse_memory_bombs, refuse_work_bombs
from distckpt.integrity.safe_pickle import load_metadata

_STOP = b"."


def _metadata(tmp_path: Path, n: int = 40) -> bytes:
    state = {f"layers.{i}.attn.proj_r.weight": torch.zeros(3, 2) for i in range(n)}
    state["step"] = torch.tensor(7)
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    return (tmp_path / ".metadata").read_bytes()


def _with(data: bytes, ops: bytes) -> bytes:
    """``data`` (ends in STOP) with ``ops`` run just before its STOP: the scan must walk every
    opcode of ``data`` to reach them."""
    assert data.endswith(_STOP)
    return data[:-1] + ops + _STOP


def _objects(rng: random.Random, depth: int = 0) -> object:
    """Values of every kind pickle has an opcode for (the strings hold the bytes of PUT, GET and
    the length prefixes, and newlines)."""
    kinds = ["int", "big", "float", "str", "bytes", "none", "bool", "tuple", "list", "dict", "global", "size"]
    kind = rng.choice(kinds if depth < 3 else kinds[:7])
    if kind == "int":
        return rng.choice([0, 1, 255, 256, 65535, 65536, -1, 2**31 - 1, -(2**31)])
    if kind == "big":
        return rng.choice([2**64 + 5, -(2**100), 10**40])
    if kind == "float":
        return rng.random() * 1e300
    if kind == "str":
        return "".join(rng.choice("rpqjhX\n\x8c\x95aé…") for _ in range(rng.randrange(0, 300)))
    if kind == "bytes":
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300)))
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "global":
        return rng.choice([OrderedDict, datetime.timedelta(seconds=5), torch.float16, Path("a/b")])
    if kind == "size":
        return torch.Size([rng.randrange(9) for _ in range(rng.randrange(4))])
    items = [_objects(rng, depth + 1) for _ in range(rng.randrange(0, 6))]
    if kind == "tuple":
        return tuple(items)
    if kind == "list":
        shared = items[:1] * 3  # memo: the same object again (GET)
        return items + shared
    return {f"k{i}": v for i, v in enumerate(items)}


def test_real_metadata_and_pickles_of_every_protocol_pass(tmp_path: Path) -> None:
    refuse_memory_bombs(_metadata(tmp_path), "ok")
    rng = random.Random(5)
    for protocol in range(0, pickle.HIGHEST_PROTOCOL + 1):
        for _ in range(30):
            data = pickle.dumps(_objects(rng), protocol=protocol)
            refuse_memory_bombs(data, "ok")  # no false alarm
            # ... and the scan walked all of it: a bomb before its STOP is found.
            with pytest.raises(UnsafeCheckpointError, match="memo slot"):
                refuse_memory_bombs(_with(data, b"Nr" + struct.pack("<I", len(data) + 9) + b"0"), "bomb")


def test_a_bomb_at_any_opcode_of_real_metadata_is_refused(tmp_path: Path) -> None:
    data = _metadata(tmp_path)
    positions = [pos for _, _, pos in pickletools.genops(data)]
    rng = random.Random(11)
    for pos in rng.sample(positions, 60) + positions[-3:]:
        bomb = data[:pos] + b"Nr" + struct.pack("<I", 50_000_000) + b"0" + data[pos:]
        with pytest.raises(UnsafeCheckpointError, match="LONG_BINPUT writes memo slot 50,000,000"):
            refuse_memory_bombs(bomb, "x")


@pytest.mark.parametrize(
    "ops, named",
    [
        (b"Nr" + struct.pack("<I", 50_000_000) + b"0", "LONG_BINPUT writes memo slot 50,000,000"),
        (b"Np50000000\n0", "PUT writes memo slot 50,000,000"),
        (b"Np +50_000_000\n0", "PUT writes memo slot 50,000,000"),  # as int() reads the line
        (b"\x8e" + struct.pack("<Q", 1 << 40) + b"abc", "BINBYTES8 declares 1,099,511,627,776 bytes"),
        (b"\x8d" + struct.pack("<Q", 1 << 40) + b"abc", "BINUNICODE8 declares"),
        (b"\x96" + struct.pack("<Q", 1 << 40) + b"abc", "BYTEARRAY8 declares"),
        (b"B" + struct.pack("<I", 1 << 31) + b"abc", "BINBYTES declares"),
        (b"X" + struct.pack("<I", 1 << 31) + b"abc", "BINUNICODE declares"),
    ],
)
def test_load_metadata_refuses_memory_bombs_by_name(tmp_path: Path, ops: bytes, named: str) -> None:
    crafted = _with(_metadata(tmp_path, 4), ops)
    where = str(tmp_path / ".metadata")
    with pytest.raises(UnsafeCheckpointError) as info:
        load_metadata(crafted, where)
    assert named in str(info.value) and where in str(info.value), str(info.value)


def test_what_the_scan_leaves_to_the_unpickler_is_still_refused(tmp_path: Path) -> None:
    data = _metadata(tmp_path, 4)
    # Cut between two opcodes near the middle (a cut inside a string is a length that runs past
    # the end: the scan's own refusal, not this test's case; where the middle falls depends on
    # the torch that wrote the file).
    middle = min((pos for _, _, pos in pickletools.genops(data) if pos), key=lambda pos: abs(pos - len(data) // 2))
    for crafted in (data[:middle], _with(data, b"\xff"), _with(data, b"p-3\n"), _with(data, b"pxyz\n"), b"", b"r\x00"):
        refuse_memory_bombs(crafted, "x")  # not a bomb: the unpickler's own error
        with pytest.raises(UnsafeCheckpointError, match="not valid DCP metadata|not DCP Metadata"):
            load_metadata(crafted, "x")


def test_fuzzed_metadata_raises_nothing_but_unsafe(tmp_path: Path) -> None:
    """Seeded: flipped, inserted and deleted bytes anywhere: the scan raises nothing else (no
    IndexError from a length at the end, no slow path on a huge digit line)."""
    data = _metadata(tmp_path, 8)
    rng = random.Random(int(os.environ.get("DISTCKPT_FUZZ_SEED", "3")))
    for _ in range(400):
        crafted = bytearray(data)
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(crafted))
            what = rng.randrange(3)
            if what == 0:
                crafted[at] = rng.randrange(256)
            elif what == 1:
                crafted[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
            else:
                del crafted[at : at + rng.randrange(1, 9)]
        try:
            refuse_memory_bombs(bytes(crafted), "x")
        except UnsafeCheckpointError:
            pass
    refuse_memory_bombs(b"p" + b"9" * 10_000 + b"\n.", "x")  # int() refuses it: left to the unpickler


def test_the_scan_costs_a_fraction_of_the_unpickling(tmp_path: Path) -> None:
    """Not a timing assertion: the scan's fast path is one regular expression per run of
    fixed-size opcodes, so Python sees only the opcodes that carry a length or a line. Counted,
    not timed: a DCP metadata of 300 items needs one Python step per string, not per opcode."""
    import distckpt.integrity.pickle_scan as scan

    data = _metadata(tmp_path, 300)
    steps = 0
    real = scan._COUNTED

    class Counting(dict):
        def get(self, key, default=None):  # type: ignore[override]
            nonlocal steps
            steps += 1
            return real.get(key, default)

    opcodes = sum(1 for _ in pickletools.genops(data))
    strings = sum(1 for op, _, _ in pickletools.genops(data) if op.name in ("SHORT_BINUNICODE", "BINUNICODE"))
    scan._COUNTED = Counting()
    try:
        refuse_memory_bombs(data, "x")
    finally:
        scan._COUNTED = real
    assert steps <= strings + 2 and opcodes > 20 * steps, (steps, strings, opcodes)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


# -- found by an attacker's review of the scan (2026-11-27) -------------------------------------


def test_a_nul_in_a_put_line_hides_nothing_after_it() -> None:
    """The unpickler reads a PUT line as a C string (up to a NUL): ``p150000000\\x00\\n`` is slot
    150,000,000 to it, and the scan stopped at a line ``int()`` refused, so a bomb after
    ``p0\\x00\\n`` went through (8 GiB)."""
    # Slots of 30,000,000 (480 MB, should this regress), not the attack's 150,000,000.
    for crafted in (b"Np30000000\x00\n.", b"Np0\x00\nNr" + struct.pack("<I", 30_000_000) + b"."):
        with pytest.raises(UnsafeCheckpointError, match="memo slot"):
            load_metadata(crafted, "x")


def _metadata_with(storage_meta: object) -> bytes:
    from torch.distributed.checkpoint.metadata import Metadata

    return pickle.dumps(Metadata(state_dict_metadata={}, storage_meta=storage_meta))


#: Crafted ``.metadata`` that amplify through the admitted constructors, and the call each names.
_CONSTRUCTOR_BOMBS = [
    # Path(p, p) again and again: 2**40 parts from 476 bytes (it never finished).
    (b"\x80\x02cpathlib\nPosixPath\nq\x00h\x00X\x01\x00\x00\x00a\x85Rq\x01" + b"0h\x00h\x01h\x01\x86Rq\x01" * 40 + b".",
     "pathlib.PosixPath(PosixPath, PosixPath)"),
    # Path("a/" * 5000, ... 10,000 times): 383 MB from 20 KB.
    (b"\x80\x02cpathlib\nPosixPath\nq\x00(X\x10'\x00\x00" + b"a/" * 5000 + b"q\x01" + b"2" * 10_000 + b"tR.",
     "pathlib.PosixPath(str, str, str, str, ...)"),
    # torch.Size of one list of 20,000 ints, made 2,000 times: 305 MB from 30 KB.
    (b"\x80\x02ctorch\nSize\nq\x00]q\x01(" + b"K\x01" * 20_000 + b"e" + b"h\x00h\x01\x85R0" * 2_000 + b"N.",
     "torch.Size(list)"),
    (b"\x80\x02ccollections\nOrderedDict\n}\x85R.", "collections.OrderedDict(dict)"),
    # A KeyError of a deep frozenset: its message recursed (a RecursionError escaped).
    (b"\x80\x04ctorch.serialization\n_get_layout\n(" + b"(" * 5000 + b"\x91" * 5000 + b"tR.",
     "torch.serialization._get_layout(frozenset)"),
]


@pytest.mark.parametrize("crafted, named", _CONSTRUCTOR_BOMBS)
def test_admitted_constructors_take_only_what_dcp_gives_them(crafted: bytes, named: str, monkeypatch) -> None:
    # The bounds on each constructor hold on their own (the work scan, which refuses most of
    # these first, is the next test's).
    monkeypatch.setattr(safe_pickle, "refuse_work_bombs", lambda data, where, **kw: 0)
    with pytest.raises(UnsafeCheckpointError, match="which DCP metadata never does") as info:
        load_metadata(crafted, "x/.metadata")
    assert named in str(info.value), str(info.value)


@pytest.mark.parametrize("crafted, named", _CONSTRUCTOR_BOMBS)
def test_the_work_scan_refuses_constructor_amplification_before_any_constructor_runs(crafted: bytes, named: str) -> None:
    if named == "collections.OrderedDict(dict)":  # no amplification: for the constructor's bound alone
        assert refuse_work_bombs(crafted, "x") < 100
        return
    with pytest.raises(UnsafeCheckpointError, match="would hash, compare or copy more than") as info:
        load_metadata(crafted, "x/.metadata")
    assert "x/.metadata" in str(info.value)


def test_metadata_with_paths_sizes_and_layouts_still_loads() -> None:
    from torch.distributed.checkpoint.metadata import StorageMeta

    for checkpoint_id in (Path("runs/a/step_1"), "s3://bucket/x", None):
        loaded = load_metadata(_metadata_with(StorageMeta(checkpoint_id=checkpoint_id)), "x")
        assert loaded.storage_meta.checkpoint_id == checkpoint_id
    with pytest.raises(UnsafeCheckpointError, match="more than 4096 characters"):
        load_metadata(_metadata_with(StorageMeta(checkpoint_id=Path("x" * 5000))), "x")


def test_a_name_in_torch_is_looked_up_without_importing_anything() -> None:
    """``getattr(torch, "_dynamo")`` imports torch._dynamo (a second of the load, for a crafted
    name that is refused anyway); only torch's own attributes are looked at."""
    import subprocess

    code = (
        "import sys, torch\nfrom distckpt.integrity.safe_pickle import load_metadata\n"
        "for name in ('_dynamo', 'onnx'):\n"
        "    try:\n        load_metadata(b'ctorch\\n' + name.encode() + b'\\n.', 'x')\n"
        "    except Exception as exc:\n        assert 'references torch.' + name in str(exc), exc\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch.onnx') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _build_reused(module: str, name: str, keys: int = 4000, objects: int = 4000) -> bytes:
    """One attribute dict of ``keys`` entries, memoized, given by ``BUILD`` to ``objects`` new
    objects of class ``module.name``: before, each got a copy (75 KB: 400 MB and 2.7 s)."""
    out = bytearray(b"\x80\x02" + f"c{module}\n{name}\nq\x00".encode() + b"}q\x01(")
    for i in range(keys):
        key = f"k{i}".encode()
        out += b"X" + len(key).to_bytes(4, "little") + key + b"K\x01"
    out += b"u0]q\x02(" + b"h\x00)\x81h\x01b" * objects + b"e."
    return bytes(out)


@pytest.mark.parametrize(
    "module, name",
    [("torch.distributed.checkpoint.metadata", c) for c in ("BytesStorageMetadata", "MetadataIndex", "ChunkStorageMetadata",
                                                            "TensorStorageMetadata", "Metadata", "StorageMeta")]
    + [("torch.distributed.checkpoint.filesystem", "_StorageInfo")],
)  # fmt: skip
def test_one_attribute_dict_given_to_many_objects_is_refused_at_the_first(module: str, name: str, monkeypatch) -> None:
    import resource

    crafted = _build_reused(module, name)
    # Refused twice over: by the work scan before anything is unpickled ...
    with pytest.raises(UnsafeCheckpointError, match=r"x/.metadata: unpickling its [\d,]+-byte pickle would hash, compare or copy"):
        load_metadata(crafted, "x/.metadata")
    # ... and by the stand-ins at the first object, where the scan is not there.
    monkeypatch.setattr(safe_pickle, "refuse_work_bombs", lambda data, where, **kw: 0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(UnsafeCheckpointError, match=rf"x/.metadata: it gives a {name} the attributes dict of 4000 items"):
        load_metadata(crafted, "x/.metadata")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50 * 1024  # KiB: not hundreds of MB


def test_an_ordered_dict_is_read_as_a_dict_that_takes_no_attributes(monkeypatch) -> None:
    # OrderedDict instances have attributes: the same memoized dict given to each by BUILD was
    # copied each time. DCP never gives them any; a plain dict (ordered) has none to give.
    crafted = b"\x80\x02ccollections\nOrderedDict\nq\x00}q\x01(X\x01\x00\x00\x00aK\x01u0]q\x02(" + b"h\x00)Rh\x01b" * 3 + b"e."
    with pytest.raises(UnsafeCheckpointError, match=r"gives attributes \(BUILD\) to what a call returned"):
        load_metadata(crafted, "x")  # the work scan's strict rule, first
    monkeypatch.setattr(safe_pickle, "refuse_work_bombs", lambda data, where, **kw: 0)
    with pytest.raises(UnsafeCheckpointError, match="not valid DCP metadata"):
        load_metadata(crafted, "x")
    ordered = pickle.dumps(OrderedDict([("b", 1), ("a", 2)]), protocol=2)
    with pytest.raises(UnsafeCheckpointError, match="holds a dict, not DCP Metadata"):
        load_metadata(ordered, "x")


@pytest.mark.parametrize("target", ["class", "member"])
def test_a_build_aimed_at_torchs_memory_format_enum_is_refused_and_undone(target: str, monkeypatch) -> None:
    """The enum the allow-list hands out as it is (and its members) is shared by the process: a
    BUILD aimed at it changed how every later save pickles tensor properties."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING as E

    enum = b"ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n"
    if target == "class":  # BUILD with (None, {name: value}): setattr on the class
        crafted = b"\x80\x02" + enum + b"N}X\x05\x00\x00\x00zz_atX\x01\x00\x00\x00xs\x86b."
    else:  # the member E(2) (TORCH_CONTIGUOUS_FORMAT), its __dict__ updated
        crafted = b"\x80\x02" + enum + b"K\x02\x85R}X\x07\x00\x00\x00_value_K\x07sb."
    snapshot = (dict(vars(E)), {m: dict(vars(m)) for m in E})
    with pytest.raises(UnsafeCheckpointError, match=r"gives attributes \(BUILD\) to"):
        load_metadata(crafted, "x")  # the work scan's strict rule, before anything is unpickled
    assert vars(E).keys() == snapshot[0].keys()
    monkeypatch.setattr(safe_pickle, "refuse_work_bombs", lambda data, where, **kw: 0)
    with pytest.raises(UnsafeCheckpointError, match="sets attributes of torch's .*which DCP metadata never does"):
        load_metadata(crafted, "x")
    assert not hasattr(E, "zz_at") and vars(E).keys() == snapshot[0].keys()
    assert all(vars(m) == snapshot[1][m] for m in E) and E(2).value == 2


def test_an_object_missing_a_field_dcp_always_writes_is_refused_by_name(tmp_path) -> None:
    """A fuzzed byte made a _StorageInfo lose relative_path: the validation met an
    AttributeError where it read it (seen once in 200 fuzz cases, depending on the bytes)."""
    dcp.save({"w": torch.zeros(3)}, checkpoint_id=tmp_path)
    md = pickle.loads((tmp_path / ".metadata").read_bytes())
    info = next(iter(md.storage_data.values()))
    del info.__dict__["relative_path"]
    with pytest.raises(UnsafeCheckpointError, match="x/.metadata: it gives a _StorageInfo no relative_path, which DCP always writes"):
        load_metadata(pickle.dumps(md), "x/.metadata")
