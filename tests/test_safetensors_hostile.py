"""Seeded fuzzing of the Hugging Face safetensors reader (``hf.load_pretrained``).

A small model is published once (sharded: three files + index; single file, with and without its
index). Each case copies one of them and applies one seeded mutation, as an attacker or a broken
upload would: a header field (dtype, shape, data_offsets: overlapping, outside the file, huge,
of the wrong type), the header as a whole (length prefix, non-object JSON, cut, bit flips), the
index (a file outside the directory, a symbolic link, a pickle, a missing file, a malformed
weight_map), planted pickles or extra ``.safetensors`` files beside the shards, a shard replaced
by a symbolic link. Bytes *inside* tensor data are not mutated: safetensors carries no checksum,
so a flipped value is undetectable by design.

Each case must either load exactly the saved tensors or raise one of distckpt's documented
errors, and never run code (a marker file) or allocate much memory (peak RSS). More cases:
``DISTCKPT_HF_FUZZ_CASES=3000``.

The publish record (``.distckpt-publish.json``, the files ``save_pretrained`` wrote) is read back
by every publish into a folder: its own seeded mutations (fields, entries naming paths outside
the folder or the user's files, bit flips, cuts, a link, a directory, shards replaced by links,
files the user rewrote) must end in an exact publish or a documented error, and never in a
changed or deleted file distckpt did not write. More cases: ``DISTCKPT_HF_RECORD_FUZZ_CASES=3000``.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import resource
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import distckpt
from distckpt.tools import hf
from distckpt.tools.safetensors_io import INDEX_NAME
from fuzz_checkpoints import _json_paths

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")

CASES = int(os.environ.get("DISTCKPT_HF_FUZZ_CASES", "300"))
SEED = 20240611
# Documented outcomes of a hostile directory. TypeError: a tensor's dtype changed to one the
# model's tensor cannot take (an int for a float), which load_pretrained reports as a TypeError.
ALLOWED = (distckpt.IntegrityError, distckpt.UnsafeCheckpointError, FileNotFoundError, distckpt.StateMismatchError, TypeError)


class _Model(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(8, 6)
        self.b = nn.Linear(6, 4)
        self.register_buffer("counts", torch.arange(5, dtype=torch.int64) * (seed + 1))


class _Planted:
    """Unpickling this would create the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def _read(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(path: Path, header_bytes: bytes, data: bytes, length: int | None = None) -> None:
    n = len(header_bytes) if length is None else length
    path.write_bytes((n % 2**64).to_bytes(8, "little") + header_bytes + data)


def _odd_shape(rng: random.Random, shape: list) -> object:
    return rng.choice([
        list(reversed(shape)), shape + [1], shape[:-1], [], [-1] + shape[1:], [2**40] + shape[1:], [2**63],
        [0, 2**70], [1.5], "abc", None, [True] + shape[1:], [1] * 100, [[2]], {"0": 2},
        [shape[0] + 1] + shape[1:] if shape else [1],
    ])  # fmt: skip


def _odd_offsets(rng: random.Random, offsets: list, others: list, data_len: int) -> object:
    b, e = offsets
    other = rng.choice(others) if others else [0, 0]
    k = rng.randint(1, 16)
    return rng.choice([
        [b + k, e + k], [b - k, e - k], [e, b], [b, e + k], [b, e - k], [other[0], other[0] + (e - b)],
        [data_len - (e - b) + k, data_len + k], [b + 2**63, e + 2**63], [b, 2**64], [-k, e - b - k],
        [b, e, 0], [b], [float(b), float(e)], [str(b), e], "0-4", None, [False, e], [b, None],
    ])  # fmt: skip


def _mutate_header(d: Path, rng: random.Random) -> str:
    shards = sorted(d.glob("*.safetensors"))
    path = rng.choice(shards)
    header, data = _read(path)
    keys = [k for k in header if k != "__metadata__"]
    key = rng.choice(keys)
    how = rng.choice(["dtype", "shape", "shape", "offsets", "offsets", "offsets", "delete", "extra",
                      "entry", "metadata", "whole", "length", "cut", "append", "flip"])  # fmt: skip
    if how == "dtype":
        header[key]["dtype"] = rng.choice(["F16", "BF16", "F64", "I32", "U32", "I64", "U8", "BOOL", "F8_E4M3", "X32", 5, None, ["F32"]])
    elif how == "shape":
        header[key]["shape"] = _odd_shape(rng, header[key]["shape"])
    elif how == "offsets":
        others = [header[k]["data_offsets"] for k in keys if k != key]
        header[key]["data_offsets"] = _odd_offsets(rng, header[key]["data_offsets"], others, len(data))
    elif how == "delete":
        del header[key]
    elif how == "extra":
        a = rng.randrange(len(data) + 8)
        header["zz.extra"] = {"dtype": "F32", "shape": [rng.randint(0, 3)], "data_offsets": [a, a + 4 * rng.randint(0, 3)]}
    elif how == "entry":
        header[key] = rng.choice([1, "x", [1, 2], None, True])
    elif how == "metadata":
        header["__metadata__"] = rng.choice([1, [1], {"format": 5}, "x", None])
    if how in ("dtype", "shape", "offsets", "delete", "extra", "entry", "metadata"):
        _write(path, json.dumps(header).encode(), data)
        return f"{path.name}: {how} of {key!r}: {json.dumps(header.get(key))[:100]}"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    if how == "whole":
        text = rng.choice([b"[]", b"1", b"null", b"{", b"[" * 5000, b'"x"', b"\xff\xfe{}", b"{}", b'{"a": {"dtype": "F32"}}'])
        _write(path, text, data)
        return f"{path.name}: header replaced by {text[:20]!r}"
    if how == "length":
        length = rng.choice([n + rng.randint(1, 16), n - rng.randint(1, 16), 0, 2**63, 2**64 - 1, len(raw) - 7, 100 * 2**20 + 1])
        _write(path, raw[8 : 8 + n], raw[8 + n :], length=length)
        return f"{path.name}: header length {n} -> {length}"
    if how == "cut":
        at = rng.randrange(len(raw))
        path.write_bytes(raw[:at])
        return f"{path.name}: cut at {at} of {len(raw)}"
    if how == "append":
        path.write_bytes(raw + os.urandom(rng.randint(1, 64)))
        return f"{path.name}: bytes appended"
    at = rng.randrange(8 + n)  # the length prefix or the header, never tensor data
    flipped = bytearray(raw)
    flipped[at] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(flipped))
    return f"{path.name}: bit flipped at {at} (header of {n} bytes)"


def _mutate_index(d: Path, rng: random.Random, marker: Path) -> str:
    path = d / INDEX_NAME
    if not path.exists():
        return _plant(d, rng, marker)
    index = json.loads(path.read_text())
    wm = index["weight_map"]
    key = rng.choice(sorted(wm))
    how = rng.choice(["value", "value", "value", "delete_key", "extra_key", "weight_map", "raw", "remove"])
    if how == "value":
        shards = sorted(p.name for p in d.glob("*.safetensors"))
        value = rng.choice(["../outside.safetensors", "/etc/passwd", "sub/model.safetensors", ".", "..", "missing.safetensors",
                            "pytorch_model.bin", 5, None, "link.safetensors", shards[0] + "\x00", "", rng.choice(shards)])  # fmt: skip
        if value == "link.safetensors":
            os.symlink(d / wm[key], d / "link.safetensors")
        if value == "pytorch_model.bin":
            (d / value).write_bytes(pickle.dumps(_Planted(str(marker))))
        # every key of that file, so the mutation is not just a misplaced key
        for k in [k for k, v in wm.items() if v == wm[key]]:
            wm[k] = value
        what = f"files of {key!r} -> {value!r}"
    elif how == "delete_key":
        del wm[key]
        what = f"weight_map[{key!r}] deleted"
    elif how == "extra_key":
        wm["zz.ghost"] = wm[key]
        what = "a key no file holds"
    elif how == "weight_map":
        index["weight_map"] = rng.choice([[], "x", None, {}, {"a.weight": 1}])
        what = f"weight_map = {index['weight_map']!r}"
    elif how == "raw":
        text = rng.choice(["[", "[" * 100000, "null", '{"weight_map": 1}', "\udcff"])
        path.write_bytes(text.encode("utf-8", "surrogateescape"))
        return f"index replaced by {text[:10]!r}"
    else:
        path.unlink()
        return "index removed"
    path.write_text(json.dumps(index))
    return f"index: {what}"


def _plant(d: Path, rng: random.Random, marker: Path) -> str:
    payload = pickle.dumps(_Planted(str(marker)))
    name = rng.choice(["pytorch_model.bin", "model.pt", "optimizer.pt", "model.safetensors.bin", "extra.safetensors", "model.ckpt"])
    (d / name).write_bytes(payload)
    return f"planted pickle {name}"


def _symlink(d: Path, rng: random.Random, outside: Path) -> str:
    target = rng.choice(sorted(d.iterdir()))
    copy = outside / f"{target.name}.{rng.randrange(10**9)}"
    shutil.copy(target, copy)
    target.unlink()
    os.symlink(copy, target)
    return f"{target.name} replaced by a symbolic link out of the directory"


def _load(d: Path) -> str:
    model = _Model(1)
    hf.load_pretrained(model, str(d))
    expected = _Model(0).state_dict()
    got = model.state_dict()
    same = sorted(got) == sorted(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    return "exact" if same else "WRONG DATA"


def test_hostile_safetensors_directories_load_exactly_or_fail_with_a_documented_error(tmp_path):
    bases = {}
    model = _Model(0)
    for name, shard in (("sharded", 200), ("single", "1MB")):
        bases[name] = tmp_path / name
        hf.save_pretrained(model, str(bases[name]), max_shard_size=shard)
    assert len(list(bases["sharded"].glob("*.safetensors"))) == 3
    bases["bare"] = tmp_path / "bare"  # one file, no index (what transformers writes for small models)
    shutil.copytree(bases["single"], bases["bare"])
    (bases["bare"] / INDEX_NAME).unlink()
    for base in bases.values():
        assert _load(base) == "exact"

    marker = tmp_path / "PLANTED_CODE_RAN"
    outside = tmp_path / "outside"
    outside.mkdir()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    rng = random.Random(SEED)
    problems, outcomes = [], {}
    for case in range(CASES):
        base = rng.choice(sorted(bases))
        d = tmp_path / "cases" / f"{case}"
        shutil.copytree(bases[base], d, symlinks=True)
        kind = rng.choice(["header", "header", "header", "index", "index", "plant", "symlink"])
        if kind == "header":
            what = _mutate_header(d, rng)
        elif kind == "index":
            what = _mutate_index(d, rng, marker)
        elif kind == "plant":
            what = _plant(d, rng, marker)
        else:
            what = _symlink(d, rng, outside)
        try:
            outcome = _load(d)
        except ALLOWED as exc:
            outcome = f"error {type(exc).__name__}"
            if len(str(exc)) > 2000:
                problems.append(f"case {case} ({base}, {what}): a {len(str(exc))}-character message")
        except BaseException as exc:  # noqa: BLE001 - what the test looks for
            outcome = f"UNDOCUMENTED {type(exc).__module__}.{type(exc).__name__}: {str(exc)[:200]}"
        if outcome not in ("exact",) and not outcome.startswith("error "):
            problems.append(f"case {case} ({base}, {what}): {outcome}")
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        shutil.rmtree(d)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert not marker.exists(), "a planted pickle was unpickled"
    assert not problems, f"{len(problems)} of {CASES} cases ({outcomes}):\n" + "\n".join(problems[:20])
    assert grown_mib < 200, f"peak memory grew by {grown_mib:.0f} MiB while reading tiny hostile files"
    # The fuzz reached both outcomes and several error kinds.
    assert outcomes.get("exact", 0) > 0 and len(outcomes) >= 4, outcomes


# the publish record (``.distckpt-publish.json``), read back by every publish into a folder --------
RECORD_CASES = int(os.environ.get("DISTCKPT_HF_RECORD_FUZZ_CASES", "120"))
RECORD = ".distckpt-publish.json"  # hf_publish.RECORD_NAME
# Documented outcomes of a publish over a hostile record: the record refused (malformed, a path
# leaving the folder, a link), or files distckpt did not write (per the record) refused.
PUBLISH_ALLOWED = (distckpt.IntegrityError, distckpt.UnsafeCheckpointError, FileExistsError)
USER_FILES = {"tokenizer.json": b'{"version": "1.0"}', "README.md": b"# model\n", "notes/train.log": b"loss 2.3\n"}


class _Config:
    def __init__(self, text: str) -> None:
        self.text = text

    def to_json_string(self) -> str:
        return self.text


def _odd_record_value(rng: random.Random, d: Path, outside: Path) -> object:
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    return rng.choice([
        "../outside.safetensors", str(outside / "outside.safetensors"), "tokenizer.json", "README.md", "notes",
        "notes/train.log", "", ".", "..", "model.safetensors\x00", "model.safetensors", "config.json", INDEX_NAME,
        rng.choice(shards), "model-00009-of-00009.safetensors", 5, -1, 2**70, 1.5, True, None, [], {}, "x" * 300,
        "A" * 64, "0" * 64, "f" * 63, [{"name": "tokenizer.json", "size": 18}],
    ])  # fmt: skip


def _mutate_record(d: Path, outside: Path, rng: random.Random) -> tuple[str, set[Path]]:
    """One seeded mutation of the folder's record (or of a file it names); returns what was done
    and the files that are no longer distckpt's (they must survive the next publish)."""
    path = d / RECORD
    raw = path.read_bytes()
    how = rng.choice(["field", "field", "field", "delete", "entry", "flip", "cut", "raw", "link", "dir",
                      "shard_link", "rewrite", "remove_file", "pending"])  # fmt: skip
    if how in ("field", "delete", "entry", "pending"):
        body = json.loads(raw)
        if how == "pending":
            body["complete"] = False
            path.write_text(json.dumps(body))
            return "record: complete -> false", set()
        if how == "entry":
            body["files"].append({"name": _odd_record_value(rng, d, outside), "size": rng.choice([0, 4, 18, -1, 2**64, "4"])})
            path.write_text(json.dumps(body))
            return f"record: entry {body['files'][-1]!r:.80} added", set()
        target = rng.choice(_json_paths(body)[1:])
        parent = body
        for k in target[:-1]:
            parent = parent[k]
        if how == "delete":
            del parent[target[-1]]
        else:
            parent[target[-1]] = _odd_record_value(rng, d, outside)
        path.write_text(json.dumps(body))
        return f"record: {how} {target}", set()
    if how == "flip":
        data = bytearray(raw)
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        return f"record: flip byte {i}", set()
    if how == "cut":
        n = rng.randrange(len(raw))
        path.write_bytes(raw[:n])
        return f"record: cut at {n}", set()
    if how == "raw":
        text = rng.choice([b"", b"[]", b"null", b"{", b"[" * 100000, b"\xff\xfe", pickle.dumps({"files": []})])
        path.write_bytes(text)
        return f"record: replaced by {text[:10]!r}", set()
    if how == "link":
        crafted = outside / f"crafted-{rng.randrange(10**9)}.json"
        crafted.write_bytes(raw.replace(b'"model-00001-of-00003.safetensors"', b'"../outside.safetensors"'))
        path.unlink()
        os.symlink(crafted, path)
        return "record: a symbolic link out of the folder", {crafted}
    if how == "dir":
        path.unlink()
        path.mkdir()
        return "record: a directory", set()
    shards = sorted(d.glob("model-*.safetensors"))
    if how == "shard_link":
        victim = rng.choice(shards)
        victim.unlink()
        os.symlink(outside / "outside.safetensors", victim)
        return f"{victim.name}: a symbolic link out of the folder", set()
    if how == "rewrite":
        victim = rng.choice([d / "config.json", d / INDEX_NAME, *shards])
        victim.write_bytes(victim.read_bytes() + b" ")
        return f"{victim.name}: rewritten by the user", {victim}
    victim = rng.choice([d / "config.json", d / INDEX_NAME, *shards])
    victim.unlink()
    return f"{victim.name}: removed", set()


def test_hostile_publish_records_never_let_a_publish_touch_other_files(tmp_path):
    """Seeded mutations of the record a publish reads back (and of the files it names): every
    ``save_pretrained(overwrite=True)`` then publishes exactly the new model or raises a documented
    error, and never changes or deletes a file distckpt did not write, inside or outside the folder."""
    base, outside = tmp_path / "base", tmp_path / "outside"
    outside.mkdir()
    (outside / "outside.safetensors").write_bytes(b"keep")
    hf.save_pretrained(_Model(0), str(base), max_shard_size=200, config=_Config('{"a": 1}'))
    assert len(list(base.glob("model-*.safetensors"))) == 3
    for name, data in USER_FILES.items():
        (base / name).parent.mkdir(exist_ok=True)
        (base / name).write_bytes(data)
    new = _Model(1)
    rng = random.Random(SEED + 1)
    problems, outcomes = [], {}
    for case in range(RECORD_CASES):
        d = tmp_path / "cases" / f"{case}"
        shutil.copytree(base, d, symlinks=True)
        what, theirs = _mutate_record(d, outside, rng)
        protected = {d / n for n in USER_FILES} | set(outside.iterdir()) | theirs
        before = {p: p.read_bytes() for p in protected if p.is_file() and not p.is_symlink()}
        config = rng.choice([None, _Config('{"b": 2}')])
        try:
            summary = hf.save_pretrained(new, str(d), max_shard_size=rng.choice([200, "1MB"]), overwrite=True, config=config)
            outcome = "published"
            expected = {str(d / n) for n in [*summary["files"], INDEX_NAME, RECORD, *USER_FILES]} | {str(p) for p in theirs if p.parent == d}
            if config is not None:
                expected.add(str(d / "config.json"))
            elif d / "config.json" in theirs or (d / "config.json").exists():
                expected.add(str(d / "config.json"))  # a config distckpt did not write (or no longer owns) stays
            got = {str(p) for p in d.rglob("*") if p.is_file() or p.is_symlink()}
            if got != expected:
                problems.append(f"case {case} ({what}): files {sorted(got ^ expected)} differ from the publish")
            elif _load_as(d, new) != "exact":
                problems.append(f"case {case} ({what}): the publish does not load exactly")
        except PUBLISH_ALLOWED as exc:
            outcome = f"error {type(exc).__name__}"
        except BaseException as exc:  # noqa: BLE001 - what the test looks for
            outcome = f"UNDOCUMENTED {type(exc).__module__}.{type(exc).__name__}: {str(exc)[:200]}"
            problems.append(f"case {case} ({what}): {outcome}")
        for p, data in before.items():
            if not p.is_file() or p.read_bytes() != data:
                problems.append(f"case {case} ({what}): {p} was changed or deleted ({outcome})")
        leftovers = [p.name for p in (tmp_path / "cases").iterdir() if p.name != str(case)]
        if leftovers:
            problems.append(f"case {case} ({what}): temporary directories left: {leftovers}")
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        shutil.rmtree(d)
    assert not problems, f"{len(problems)} problems in {RECORD_CASES} cases ({outcomes}):\n" + "\n".join(problems[:20])
    assert outcomes.get("published", 0) > 0 and len(outcomes) >= 3, outcomes


def _load_as(d: Path, expected_model: nn.Module) -> str:
    model = _Model(5)
    hf.load_pretrained(model, str(d))
    expected = expected_model.state_dict()
    got = model.state_dict()
    return "exact" if all(torch.equal(got[k], expected[k]) for k in expected) else "WRONG DATA"


@pytest.mark.parametrize(
    "case,why",
    [
        ("nan", "not valid JSON"),
        ("meta", "__metadata__ must map names to strings"),
        ("bom", "byte-order mark"),
        ("utf16", "not UTF-8"),
    ],
)
def test_headers_safetensors_refuses_are_refused(tmp_path, case, why):
    """Python's json reads what the safetensors format (and its reader) refuses: NaN in
    ``__metadata__``, metadata values that are not strings, a byte-order mark, UTF-16. A folder
    only distckpt could read passed for a checkpoint. Found by a helper (2026-11-29)."""
    import json as _json

    from distckpt.tools import hf as _hf
    from distckpt.tools.safetensors_io import IntegrityError as _IntegrityError

    body = torch.arange(4.0).numpy().tobytes()
    header = {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    if case == "nan":
        text = _json.dumps({"__metadata__": {"x": float("nan")}, **header})
    elif case == "meta":
        text = _json.dumps({"__metadata__": {"x": 1}, **header})
    else:
        text = _json.dumps(header)
    raw = {"bom": b"\xef\xbb\xbf" + text.encode(), "utf16": text.encode("utf-16")}.get(case, text.encode())
    raw += b" " * (-len(raw) % 8)
    (tmp_path / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + body)
    with pytest.raises(_IntegrityError, match=why):
        _hf.load_pretrained(torch.nn.Linear(2, 2), str(tmp_path))
