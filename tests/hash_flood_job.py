"""Forged checkpoints whose pickles hold many distinct keys of one hash, each read in this process.

Run by ``tests/test_hash_floods.py`` in a fresh interpreter, under a timeout (a failure here is
a process that does not return for minutes: ``n`` keys of one hash cost ``n**2 / 2``
comparisons to insert, in C, holding the GIL)::

    python tests/hash_flood_job.py DIR [CASE ...]

Saves one small checkpoint under ``DIR``, then for each case copies it, forges one file as an
attacker who controls the directory would (every checksum and digest re-sealed), reads it with
``Checkpointer.load`` or ``distckpt verify --state``, and prints one JSON line per case.
"""

from __future__ import annotations

import collections
import io
import pickle
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

sys.path.insert(0, str(Path(__file__).resolve().parent))

import forge  # noqa: E402

#: ``hash(k * M) == 0`` for every integer k: Python hashes integers modulo M.
M = (1 << 61) - 1
#: Keys per case: 18M comparisons, far over the walk's budget (16 per byte of a ~100 KB pickle),
#: yet quick to forge (building the forged dicts here costs the same comparisons).
KEYS = 6_000


def colliding_ints(n: int = KEYS) -> list[int]:
    return [k * M for k in range(1, n + 1)]


class _Call:
    """Pickles as ``fn(arg)`` (``REDUCE``), as a crafted pickle may call what the allow-list admits."""

    def __init__(self, fn: object, arg: object) -> None:
        self.fn, self.arg = fn, arg

    def __reduce__(self) -> tuple:
        return (self.fn, (self.arg,))


def _record(value: object) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _forge_metadata(d: Path, kind: str) -> None:
    md = pickle.loads((d / ".metadata").read_bytes())
    if kind == "metadata-int-keys":
        md.planner_data = {k: "x" for k in colliding_ints()}
    elif kind == "metadata-tuple-keys":
        md.planner_data = {("model.0.weight", k): "x" for k in colliding_ints()}
    elif kind == "metadata-index-keys":
        # storage_data keys with offsets of one hash (their fields come by BUILD: the walk cannot see them)
        (index, info), *_ = md.storage_data.items()
        for k in colliding_ints(KEYS // 8):
            md.storage_data[MetadataIndex(index.fqn, torch.Size([k, 0]), 0)] = info
    else:
        raise ValueError(kind)
    forge.reseal(d, ".metadata", pickle.dumps(md, protocol=2))


CASES = ("metadata-int-keys", "metadata-tuple-keys", "metadata-index-keys", "value-int-keys", "value-set",
         "value-ordered-dict-pairs", "verify-metadata-int-keys", "verify-value-int-keys")  # fmt: skip


def forge_case(d: Path, case: str) -> None:
    """Forge step directory ``d`` as ``case`` says."""
    kind = case.removeprefix("verify-")
    if kind.startswith("metadata-"):
        _forge_metadata(d, kind)
    elif kind == "value-int-keys":
        forge.replace_item(d, "extra", _record({k: 0 for k in colliding_ints()}))
    elif kind == "value-set":
        forge.replace_item(d, "extra", _record(set(colliding_ints())))  # torch.save writes set([...])
    elif kind == "value-ordered-dict-pairs":
        forge.replace_item(d, "extra", _record(_Call(collections.OrderedDict, [(k, 0) for k in colliding_ints()])))
    else:
        raise ValueError(case)


if __name__ == "__main__":
    forge.run_job(sys.argv[1:], CASES, forge_case)
