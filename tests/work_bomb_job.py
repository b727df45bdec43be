"""Forged checkpoints whose pickles ask the unpickler (or the decoder) for work out of all
proportion to their size, each read in this process.

Run by ``tests/test_work_bombs.py`` in a fresh interpreter, under a timeout (a failure here is a
process that never returns: hashing a tuple that holds one tuple twice, forty levels deep,
visits 2**40 tuples in C, holding the GIL)::

    python tests/work_bomb_job.py DIR [CASE ...]

Saves one small checkpoint under ``DIR``, then for each case copies it, forges one file as an
attacker who controls the directory would (every checksum and digest re-sealed), reads it with
``Checkpointer.load`` or ``distckpt verify --state``, and prints one JSON line: the case, and the
type and message of what the read raised (``null`` where it raised nothing).
"""

from __future__ import annotations

import io
import pickle
import pickletools
import struct
import sys
import zipfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import forge  # noqa: E402

LEVELS = 40
MARK = "WORK-BOMB-GOES-HERE"


def _put(slot: int) -> bytes:
    return b"r" + struct.pack("<I", slot)


def _get(slot: int) -> bytes:
    return b"j" + struct.pack("<I", slot)


def dag_tuple(base: int, levels: int = LEVELS, pop: bool = True) -> bytes:
    """Opcodes leaving one tuple on the stack: T0 = (None,), T(i) = (T(i-1), T(i-1)), memo slots
    ``base`` on. ``pop``: each level's tuple popped once memoized (the C unpickler); else each is
    appended to a list below it (torch's weights_only unpickler knows no POP)."""
    after = b"0" if pop else b"a"
    out = b"N\x85" + _put(base) + after
    for i in range(1, levels + 1):
        out += _get(base + i - 1) + _get(base + i - 1) + b"\x86" + _put(base + i) + after
    return out + _get(base + levels)


def _free_slot(data: bytes) -> int:
    """One more than the largest memo slot ``data`` writes."""
    slots = [arg for op, arg, _ in pickletools.genops(data) if op.name in ("BINPUT", "LONG_BINPUT", "PUT")]
    return max(slots, default=-1) + 1


def _forge_metadata(d: Path) -> None:
    """A planner_data key that is the shared tuple (a dictionary key: hashed as it is unpickled)."""
    md = pickle.loads((d / ".metadata").read_bytes())
    md.planner_data = {MARK: ("x",)}
    data = pickle.dumps(md, protocol=2)
    marked = b"X" + len(MARK).to_bytes(4, "little") + MARK.encode()
    assert data.count(marked) == 1
    forge.reseal(d, ".metadata", data.replace(marked, dag_tuple(_free_slot(data))))


def _record(pkl: bytes) -> bytes:
    """A torch.save record (zip) whose ``data.pkl`` is ``pkl``."""
    buf = io.BytesIO()
    torch.save({"k": 1}, buf)
    forged = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zin, zipfile.ZipFile(forged, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, pkl if info.filename.endswith("data.pkl") else zin.read(info.filename))
    return forged.getvalue()


def dag_key_pickle() -> bytes:
    """``{"a": [T0 ... T40], T40: 1}`` for torch's unpickler: the last key hashes 2**40 tuples."""
    return b"\x80\x02}X\x01\x00\x00\x00a]" + dag_tuple(0, pop=False) + b"as" + _get(LEVELS) + b"K\x01s."


def ordered_dicts_pickle(keys: int = 2000, dicts: int = 2000) -> bytes:
    """A list of ``dicts`` OrderedDicts, each given by ``BUILD`` the one memoized dict of ``keys``
    entries (torch's unpickler copies it into each: 300 MB from 60 KB)."""
    out = b"\x80\x02]ccollections\nOrderedDict\n" + _put(0) + b"a}" + _put(1) + b"("
    out += b"".join(b"X" + struct.pack("<I", len(k)) + k + b"K\x01" for k in (b"k%d" % i for i in range(keys)))
    out += b"ua" + (_get(0) + b")R" + _get(1) + b"ba") * dicts
    return out + b"."


def dag_list_pickle() -> bytes:
    """``[L0 ... L40]`` with L(i) = [L(i-1), L(i-1)]: nothing hashes it, but a walk that does not
    remember what it has seen visits 2**40 lists."""
    out = b"\x80\x02]]K\x01a" + _put(0) + b"a"
    for i in range(1, LEVELS + 1):
        out += b"]" + _get(i - 1) + b"a" + _get(i - 1) + b"a" + _put(i) + b"a"
    return out + b"."


def overlapping_record(tensors: int = 64, floats: int = 1 << 18) -> bytes:
    """A torch.save record of a list of ``tensors`` tensors whose zip central directory names one
    stored entry (``floats`` float32) under every tensor's entry name: ``torch.load`` reads the
    same bytes into ``tensors`` storages (64 MiB from 1 MiB)."""
    buf = io.BytesIO()
    torch.save([torch.zeros(floats) for _ in range(tensors)], buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        infos = z.infolist()
        first = next(i for i in infos if i.filename.endswith("/data/0"))
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zw:
            for info in infos:
                if "/data/" not in info.filename or info is first:
                    zw.writestr(info.filename, z.read(info.filename))
    data = out.getvalue()
    end = data.rfind(b"PK\x05\x06")
    count, size, at = struct.unpack_from("<HII", data, end + 10)
    entries, p = [], at
    while p < at + size:
        nlen, elen, clen = struct.unpack_from("<HHH", data, p + 28)
        entries.append(data[p : p + 46 + nlen + elen + clen])
        p += 46 + nlen + elen + clen
    name0 = first.filename.encode()
    entry0 = next(e for e in entries if e[46 : 46 + len(name0)] == name0)
    for k in range(1, tensors):
        name = name0[:-1] + str(k).encode()
        entries.append(entry0[:28] + struct.pack("<H", len(name)) + entry0[30:46] + name + entry0[46 + len(name0) :])
    directory = b"".join(entries)
    tail = bytearray(data[end : end + 22])
    struct.pack_into("<HHII", tail, 8, len(entries), len(entries), len(directory), at)
    return data[:at] + directory + bytes(tail)


CASES = ("metadata-dag-key", "verify-metadata-dag-key", "value-dag-key", "verify-value-dag-key", "value-ordered-dicts",
         "value-dag-list", "tensor-dag-key", "verify-tensor-dag-key", "value-overlapping-entries",
         "verify-value-overlapping-entries")  # fmt: skip


def forge_case(d: Path, case: str) -> None:
    """Forge step directory ``d`` as ``case`` says."""
    kind = case.removeprefix("verify-")
    if kind == "metadata-dag-key":
        _forge_metadata(d)
    elif kind == "value-dag-key":
        forge.replace_item(d, "extra", _record(dag_key_pickle()))
    elif kind == "value-ordered-dicts":
        forge.replace_item(d, "extra", _record(ordered_dicts_pickle()))
    elif kind == "value-dag-list":
        forge.replace_item(d, "extra", _record(dag_list_pickle()))
    elif kind == "value-overlapping-entries":
        forge.replace_item(d, "extra", overlapping_record())
    elif kind == "tensor-dag-key":
        forge.replace_item(d, "model.0.weight", _record(dag_key_pickle()), offset=(0, 0))
    else:
        raise ValueError(case)


if __name__ == "__main__":
    forge.run_job(sys.argv[1:], CASES, forge_case)
