"""Forging a committed step as an attacker who controls its directory would: a file rewritten and
its size, checksum (and value digest) re-sealed in the manifest, so that only distckpt's own
checks of the content stand between the forgery and a load."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import MetadataIndex

import distckpt
from cli_runner import run_cli
from distckpt.integrity.manifest import MANIFEST_NAME, digest_of, step_dir


def reseal(d: Path, name: str, data: bytes) -> None:
    """Write ``data`` as file ``name`` of step directory ``d`` and re-seal its manifest record."""
    (d / name).write_bytes(data)
    raw = json.loads((d / MANIFEST_NAME).read_text())
    raw["files"][name] = {"size": len(data), "checksum": digest_of(data, raw["checksum_algorithm"])}
    (d / MANIFEST_NAME).write_text(json.dumps(raw))


def replace_item(d: Path, key: str, blob: bytes, offset: tuple[int, ...] | None = None) -> None:
    """Store ``blob`` (a torch.save record) as item ``key`` of step directory ``d`` (a tensor's
    shard where ``offset`` gives its offsets): its data file, ``.metadata`` (the items after it
    moved) and, for a non-tensor item, its value digest re-sealed."""
    md = pickle.loads((d / ".metadata").read_bytes())
    info = md.storage_data[MetadataIndex(key, offset)]
    data = (d / info.relative_path).read_bytes()
    new = data[: info.offset] + blob + data[info.offset + info.length :]
    for other in md.storage_data.values():
        if other.relative_path == info.relative_path and other.offset > info.offset:
            other.offset += len(blob) - info.length
    info.length = len(blob)
    reseal(d, info.relative_path, new)
    reseal(d, ".metadata", pickle.dumps(md))
    if offset is None:
        raw = json.loads((d / MANIFEST_NAME).read_text())
        raw["value_digests"][key] = hashlib.sha256(blob).hexdigest()
        (d / MANIFEST_NAME).write_text(json.dumps(raw))


# --- Jobs that forge a small checkpoint case by case (tests/*_job.py) ---------------------------


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3))


def read_case(root: Path, case: str) -> dict:
    """Read the forged checkpoint ``root`` as the case says (``verify-*``: ``distckpt verify
    --state``; else ``Checkpointer.load``): one JSON-able line for the test."""
    if case.startswith("verify"):
        done = run_cli("verify", str(root), "--state")
        return {"case": case, "code": done.returncode, "stderr": done.stderr[-2000:]}
    try:
        distckpt.Checkpointer(root).load({"model": model(1), "extra": {"epoch": 0}})
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"case": case, "error": type(exc).__name__, "message": str(exc)[:2000]}
    return {"case": case, "error": None, "message": ""}


def run_job(argv: list[str], cases: tuple[str, ...], forge_case: Callable[[Path, str], None]) -> None:
    """``job.py DIR [CASE ...]``: save one small checkpoint under ``DIR``, then for each case
    copy it, forge it (``forge_case(step directory, case)``), read it and print one JSON line."""
    base = Path(argv[0])
    distckpt.Checkpointer(base / "clean").save(1, {"model": model(0), "extra": {"epoch": 3}})
    for case in argv[1:] or cases:
        root = base / case
        shutil.copytree(base / "clean", root)
        forge_case(root / step_dir(1), case)
        print(json.dumps(read_case(root, case)), flush=True)


def run_cases(job: Path, tmp: Path, timeout: float = 240) -> dict[str, dict]:
    """Run the forging ``job`` (a script calling :func:`run_job`) on every case in a fresh
    interpreter under ``timeout``: its JSON lines, by case (a regression there is often a
    process that never returns, holding the GIL)."""
    done = subprocess.run([sys.executable, str(job), str(tmp)], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (done.returncode, done.stdout[-2000:], done.stderr[-3000:])
    return {r["case"]: r for r in map(json.loads, done.stdout.splitlines())}
