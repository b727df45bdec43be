"""Forged checkpoints whose pickles nest tuples 400,000 levels deep, each read in this process.

Run by ``tests/test_deep_nesting.py`` in a fresh interpreter (a failure here is a crash, SIGSEGV,
which must not take a test worker with it)::

    python tests/deep_nesting_job.py DIR [CASE ...]

Saves one small checkpoint under ``DIR``, then for each case copies it, forges one file as an
attacker who controls the directory would (every checksum and digest re-sealed), reads it with
``Checkpointer.load`` or ``distckpt verify --state``, and prints one JSON line: the case, and the
type and message of what the read raised (``null`` where it raised nothing). Hashing such a
tuple in C recurses once per level: ~130,000 levels overflow an 8 MiB stack.
"""

from __future__ import annotations

import io
import pickle
import sys
import zipfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

sys.path.insert(0, str(Path(__file__).resolve().parent))

import forge  # noqa: E402

LEVELS = 400_000
#: A string pickled where the deep tuple goes, then replaced by its opcodes (``pickle`` itself
#: cannot write a tuple this deep without a stack as deep).
MARK = "DEEP-NESTING-GOES-HERE"


def _deep_in_place_of_mark(data: bytes) -> bytes:
    """``data`` (protocol 2: no frames whose lengths would change) with the pickled :data:`MARK`
    replaced by an empty tuple wrapped :data:`LEVELS` times (one ``TUPLE1`` byte per level)."""
    marked = b"X" + len(MARK).to_bytes(4, "little") + MARK.encode()
    assert data.count(marked) == 1, "the mark must be pickled once (later uses are memo reads)"
    return data.replace(marked, b")" + b"\x85" * LEVELS)


def _forge_metadata(d: Path, case: str) -> None:
    md = pickle.loads((d / ".metadata").read_bytes())
    if case == "metadata-key-offset":  # a storage_data key whose offset is the deep tuple
        old = next(k for k in md.storage_data if k.offset is not None)
        key = MetadataIndex(old.fqn, old.offset, old.index)
        object.__setattr__(key, "offset", MARK)
        md.storage_data = {(key if k == old else k): v for k, v in md.storage_data.items()}
    elif case == "metadata-planner-data":  # a dictionary key: hashed as it is unpickled
        md.planner_data = {MARK: ("x",)}
    elif case == "metadata-extra-attribute":  # an attribute DCP never writes: a dict keyed by it
        md.__dict__["extra"] = {MARK: 1}
    elif case == "metadata-entry-key":  # a key of state_dict_metadata
        md.state_dict_metadata[MARK] = next(iter(md.state_dict_metadata.values()))
    else:
        raise ValueError(case)
    forge.reseal(d, ".metadata", _deep_in_place_of_mark(pickle.dumps(md, protocol=2)))


def _forge_value(d: Path, key: str, compression: int = zipfile.ZIP_STORED) -> None:
    """Item ``key``'s record (a torch.save zip, its entries written with ``compression``) with
    its ``data.pkl`` a dict keyed by the deep tuple; its file, ``.metadata`` and value digest
    re-sealed."""
    buf = io.BytesIO()
    torch.save({"k": 1}, buf)
    forged = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zin, zipfile.ZipFile(forged, "w", compression) as zout:
        for info in zin.infolist():
            body = zin.read(info.filename)
            if info.filename.endswith("data.pkl"):
                body = b"\x80\x02}" + b")" + b"\x85" * LEVELS + b"K\x01s."
            zout.writestr(info.filename, body)
    forge.replace_item(d, key, forged.getvalue())


CASES = (
    "metadata-key-offset",
    "metadata-planner-data",
    "metadata-extra-attribute",
    "metadata-entry-key",
    "value-record",
    "value-record-deflated",
    "verify-metadata",
    "verify-value-record",
)


def forge_case(d: Path, case: str) -> None:
    """Forge step directory ``d`` as ``case`` says."""
    if case in ("value-record", "verify-value-record"):
        _forge_value(d, "extra")
    elif case == "value-record-deflated":  # 400,000 levels in a 1.2 KB record
        _forge_value(d, "extra", zipfile.ZIP_DEFLATED)
    else:
        _forge_metadata(d, "metadata-key-offset" if case == "verify-metadata" else case)


if __name__ == "__main__":
    forge.run_job(sys.argv[1:], CASES, forge_case)
