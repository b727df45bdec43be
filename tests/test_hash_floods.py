"""Many distinct keys of one hash, in every pickle distckpt reads: refused before they are inserted.

A dict or set compares keys whose hashes are equal one by one: ``n`` of them cost ``n**2 / 2``
comparisons to insert. Integers hash modulo ``2**61 - 1`` and a tuple's hash is a public
function of its members', so a pickle can choose them: before, a 400 KB ``.metadata`` took 27 s
to read, a few MB would take hours. Now the opcode walk gives every immutable object its real
hash (:mod:`distckpt.integrity.hash_model`) and charges each key the comparisons it costs;
``storage_data`` keys (whose fields come by ``BUILD``) are counted as they are built; the value
decoder counts the hashes of what it inserts."""

from __future__ import annotations

import collections
import io
import pickle
import random
import struct
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from distckpt.errors import IntegrityError, UnsafeCheckpointError
from distckpt.integrity.hash_model import WILD, tuple_hash
from distckpt.integrity.work_scan import WORK_BASE, WORK_PER_BYTE, refuse_work_bombs
from distckpt.state.decoding import decode_loaded
from distckpt.state.encoded import MARKER, encode_for_save

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import forge  # noqa: E402
import hash_flood_job  # noqa: E402

M = hash_flood_job.M
P1, P2, P5, MASK = 11400714785074694791, 14029467366897019727, 2870177450012600261, (1 << 64) - 1


def _random_hashable(rng: random.Random, depth: int = 0) -> object:
    r = rng.random()
    if depth < 3 and r < 0.25:
        return tuple(_random_hashable(rng, depth + 1) for _ in range(rng.randint(0, 4)))
    if r < 0.45:
        return rng.randint(-(2**70), 2**70)
    if r < 0.6:
        return "".join(chr(rng.randint(32, 3000)) for _ in range(rng.randint(0, 6)))
    if r < 0.7:
        return rng.random() * 10 ** rng.randint(-5, 20)
    if r < 0.8:
        return rng.choice([None, True, False, -1, -2, 0.0, -0.0, float("inf")])
    if r < 0.9:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 5)))
    return rng.randint(-3, 3)


def _model(x: object) -> int:
    return tuple_hash([_model(v) for v in x]) if type(x) is tuple else hash(x)


def test_the_model_computes_every_tuples_real_hash():
    """Seeded: nested tuples of numbers, strings, bytes and constants hash, in the model, exactly
    as this process hashes them (the string hashes are this process's: the walk runs where the
    unpickler will)."""
    rng = random.Random(33)
    for _ in range(5000):
        value = _random_hashable(rng)
        assert _model(value) == hash(value), value


def _crafted_pairs(n: int) -> list[tuple[int, int]]:
    """``n`` distinct pairs of integers with one tuple hash, solved through the lanes of CPython's
    tuple hash (no integer in them equal, nor of equal hash: only the whole pairs collide)."""
    inv_p2 = pow(P2, -1, 1 << 64)

    def lane(acc: int, h: int) -> int:
        acc = (acc + (h & MASK) * P2) & MASK
        return ((((acc << 31) | (acc >> 33)) & MASK) * P1) & MASK

    target = lane(lane(P5, 1), 1)  # the state after (1, 1)
    before = (target * pow(P1, -1, 1 << 64)) & MASK
    before = ((before >> 31) | (before << 33)) & MASK  # undo the rotation
    out = []
    a = 2
    while len(out) < n:
        h = ((before - lane(P5, a)) * inv_p2) & MASK
        b = h - (1 << 64) if h >> 63 else h
        if -M < b < M and b != -1:
            out.append((a, b))
        a += 1
    assert len({hash(p) for p in out}) == 1 and hash(out[0]) == hash((1, 1))
    return out


_FAMILIES = {
    "ints": lambda n: [k * M for k in range(1, n)],
    "negative-ints": lambda n: [-k * M for k in range(1, n)],
    "str-int-tuples": lambda n: [("layer", k * M) for k in range(1, n)],
    "nested-tuples": lambda n: [((k * M,), "x") for k in range(1, n)],
    "lane-crafted-pairs": lambda n: _crafted_pairs(n),
}


@pytest.mark.parametrize(
    "family, container",
    [(f, c) for f in _FAMILIES for c in ("dict", "set", "frozenset")] + [("ints", "torch-size-keys"), ("negative-ints", "torch-size-keys")],
)
def test_the_walk_refuses_keys_of_one_hash(family, container):
    """3,000 distinct keys of one hash (4.5M comparisons) in a pickle of ~60 KB: refused by the
    walk with its named error, in dicts (``SETITEMS``), sets (``ADDITEMS``), frozensets and as
    ``torch.Size`` keys (what ``Size(dims)`` hashes to is ``hash(dims)``)."""
    ks = _FAMILIES[family](3000)
    if container == "torch-size-keys":
        value: object = {torch.Size([k]): 0 for k in ks}
    else:
        value = {"dict": lambda: {k: 0 for k in ks}, "set": lambda: set(ks), "frozenset": lambda: frozenset(ks)}[container]()
    assert len({hash(k) for k in ks}) == 1
    for protocol in (2, 4):
        data = pickle.dumps(value, protocol=protocol)
        with pytest.raises(UnsafeCheckpointError, match="keys whose hashes collide"):
            refuse_work_bombs(data, "x")


@pytest.mark.parametrize(
    "value",
    [
        pytest.param({k: 0 for k in range(200_000)}, id="200k-int-keys"),
        pytest.param({-1: 0, -2: 1, 0: 2, M: 3}, id="a-few-equal-hashes"),
        pytest.param({(f"layer{i}", 0): i for i in range(5000)}, id="name-index-tuples"),
        pytest.param({(i, j): 0 for i in range(100) for j in range(100)}, id="int-pairs"),
        pytest.param({torch.Size([i, 4]): i for i in range(3000)}, id="size-keys"),
        pytest.param({complex(i, 1): i for i in range(50)}, id="complex-keys"),
        pytest.param(set(range(100_000)) | {float(i) + 0.5 for i in range(10_000)}, id="numbers-set"),
        pytest.param(collections.OrderedDict((str(i), i) for i in range(10_000)), id="ordered-dict"),
        pytest.param([0] * 100_000, id="list-of-one-value"),
    ],
)
def test_plain_keys_cost_nothing_extra(value):
    """No false alarm: keys of real state (numbers, names with indices, pairs, shapes, a few
    keys that hash alike such as -1 and -2) are charged about what they were before, far below
    the budget; a list of one repeated value is no key at all."""
    for protocol in (2, 4, 5):
        data = pickle.dumps(value, protocol=protocol)
        assert refuse_work_bombs(data, "x") < 4 * len(data) + WORK_BASE


def _comparisons(value: object, seen: set[int] | None = None) -> int:
    """What inserting the keys and members of every dict and set in ``value`` compared: for each,
    n * (n - 1) / 2 per group of n keys of one hash."""
    seen = set() if seen is None else seen
    if id(value) in seen or not isinstance(value, (dict, set, frozenset, list, tuple)):
        return 0
    seen.add(id(value))
    total = 0
    if isinstance(value, (dict, set, frozenset)):
        groups = collections.Counter(hash(k) for k in value)
        total += sum(c * (c - 1) // 2 for c in groups.values())
    for item in list(value) + (list(value.values()) if isinstance(value, dict) else []):
        total += _comparisons(item, seen)
    return total


def _random_keys(rng: random.Random, pairs: list[tuple[int, int]]) -> list[object]:
    kind = rng.randrange(6)
    n = rng.randint(1, 40)
    if kind == 0:
        return [rng.randrange(10**6) for _ in range(n)]
    if kind == 1:
        return [rng.choice([1, -1]) * rng.randint(1, 60) * M for _ in range(n)]
    if kind == 2:
        return [(rng.choice("ab"), rng.randint(1, 60) * M) for _ in range(n)]
    if kind == 3:
        return rng.sample(pairs, min(n, len(pairs)))
    if kind == 4:
        return [f"k{rng.randrange(100)}" for _ in range(n)]
    return [rng.choice([-1, -2, 0, 1, M, -M, 2 * M]) for _ in range(n)]


def _random_value(rng: random.Random, pairs: list[tuple[int, int]], depth: int = 0) -> object:
    if depth > 2 or rng.random() < 0.3:
        return rng.choice([0, "v", None, (1, 2)])
    keys = _random_keys(rng, pairs)
    kind = rng.randrange(6)
    if kind == 0:
        return {k: _random_value(rng, pairs, depth + 1) for k in keys}
    if kind == 1:
        return set(keys)
    if kind == 2:
        return frozenset(keys)
    if kind == 3:
        return collections.OrderedDict((k, _random_value(rng, pairs, depth + 1)) for k in keys)
    if kind == 4:
        return collections.Counter(keys)
    return [_random_value(rng, pairs, depth + 1) for _ in range(rng.randint(1, 4))]


def test_the_walk_charges_at_least_the_comparisons_it_lets_through(monkeypatch):
    """Seeded: random dicts, sets, frozensets, OrderedDicts and Counters of keys drawn from
    colliding families and plain ones, nested, in protocols 2 to 5. Where the walk lets a pickle
    through, the comparisons its keys cost (counted from the unpickled value's real hashes) are
    at most the work it returned; with a budget scaled down to these small values, both outcomes
    occur."""
    from distckpt.integrity import work_scan

    monkeypatch.setattr(work_scan, "WORK_PER_BYTE", 1)
    monkeypatch.setattr(work_scan, "WORK_BASE", 64)
    pairs = _crafted_pairs(60)
    outcomes = collections.Counter()
    for seed in range(300):
        rng = random.Random(seed)
        value = _random_value(rng, pairs)
        data = pickle.dumps(value, protocol=rng.randint(2, 5))
        try:
            work = refuse_work_bombs(data, "x")
        except UnsafeCheckpointError:
            outcomes["refused"] += 1
            continue
        outcomes["read"] += 1
        assert _comparisons(pickle.loads(data)) <= work, (seed, value)
    assert outcomes["refused"] >= 20 and outcomes["read"] >= 100, outcomes


def test_collisions_are_charged_by_what_they_cost():
    """n keys of one hash are charged n**2 / 2 comparisons (times their weight), so the budget
    decides: 200 pass (20,000 comparisons), as do 16 keys per byte's worth; 3,000 do not."""
    few = pickle.dumps({k * M: 0 for k in range(1, 201)}, protocol=4)
    work = refuse_work_bombs(few, "x")
    assert 19_900 <= work - refuse_work_bombs(pickle.dumps({k: 0 for k in range(1, 201)}, protocol=4), "x") <= 2 * 19_900
    many = pickle.dumps({k * M: 0 for k in range(1, 3001)}, protocol=4)
    assert 3000 * 2999 // 2 > WORK_PER_BYTE * len(many) + WORK_BASE
    with pytest.raises(UnsafeCheckpointError):
        refuse_work_bombs(many, "x")


def test_calls_that_hash_their_argument_are_charged():
    """``set(list)``, ``Counter(dict)``, ``OrderedDict(pairs)`` (torch's allow-list admits the
    three) insert what their argument holds: a list of colliding integers is harmless until it is
    handed to one."""
    ks = [k * M for k in range(1, 3000)]
    harmless = pickle.dumps(ks, protocol=2)
    refuse_work_bombs(harmless, "x")
    for value in (
        set(ks),
        collections.Counter({k: 1 for k in ks}),
        hash_flood_job._Call(collections.OrderedDict, [(k, i) for i, k in enumerate(ks)]),
        hash_flood_job._Call(collections.Counter, ks),
    ):
        with pytest.raises(UnsafeCheckpointError, match="keys whose hashes collide"):
            refuse_work_bombs(pickle.dumps(value, protocol=2), "x")


def test_complex_keys_count_as_colliding():
    """``complex`` hashes its two parts mixed (``complex(1000003 * k, -k)`` all hash to 0): the
    model does not compute it and counts them all as one hash, so a few dozen pass, thousands not."""
    assert len({hash(complex(1000003 * k, -k)) for k in range(2, 100)}) == 1
    refuse_work_bombs(pickle.dumps({complex(k, 0): 0 for k in range(40)}, protocol=2), "x")
    with pytest.raises(UnsafeCheckpointError):
        refuse_work_bombs(pickle.dumps({complex(1000003 * k, -k): 0 for k in range(2, 3000)}, protocol=2), "x")
    assert WILD != hash(0)


def test_the_decoder_refuses_members_of_one_hash():
    """The value decoder rebuilds sets and dicts whose keys are encoded values (NumPy scalars,
    registered dataclasses, tuples): it counts the real hashes of what it inserts."""
    ks = [(np.int64(a), np.int64(b)) for a, b in _crafted_pairs(3000)]
    assert len({hash(k) for k in ks}) == 1
    encoded = encode_for_save({"s": set(ks)})["s"]
    assert type(encoded) is tuple and encoded[0] == MARKER
    with pytest.raises(IntegrityError, match="hash alike"):
        decode_loaded(encoded, "s")
    keyed = encode_for_save({"d": ({k: 0 for k in ks},)})["d"]  # (a tuple: one stored item, not flattened)
    with pytest.raises(IntegrityError, match="hash alike"):
        decode_loaded(keyed, "d")
    plain = {(np.int64(i), np.int64(j)) for i in range(60) for j in range(60)}
    assert decode_loaded(encode_for_save({"s": plain})["s"], "s") == plain


@pytest.mark.timeout(300)
def test_forged_checkpoints_with_keys_of_one_hash_are_refused_by_name(tmp_path):
    """Before, each forged checkpoint loaded after 18M key comparisons (6,000 keys of one hash;
    ten times as many keys would take a hundred times as long). Now each is refused by name where
    it is read: ``Checkpointer.load`` and ``distckpt verify --state``. A fresh interpreter under a
    timeout."""
    got = forge.run_cases(HERE / "hash_flood_job.py", tmp_path)
    collide = "keys whose hashes collide"
    expected = {
        "metadata-int-keys": (".metadata: unpickling its", collide),
        "metadata-tuple-keys": (".metadata: unpickling its", collide),
        "metadata-index-keys": (".metadata: it holds more than 64 storage keys (MetadataIndex) with one hash", "at offset <Size>"),
        "value-int-keys": ("checkpoint value 'extra'", collide),
        "value-set": ("checkpoint value 'extra'", collide),
        "value-ordered-dict-pairs": ("checkpoint value 'extra'", collide),
    }
    for case, words in expected.items():
        assert got[case]["error"] == "UnsafeCheckpointError", got[case]
        assert all(w in got[case]["message"] for w in words), got[case]
    for case in ("verify-metadata-int-keys", "verify-value-int-keys"):
        assert got[case]["code"] == 1 and collide in got[case]["stderr"], got[case]


# --- Found by an attacker's review of the first version (each got past it) ----------------------


def _metadata_index_pickle(n: int, second_build: bool) -> bytes:
    """``n`` MetadataIndex objects, each given distinct fields by ``BUILD`` (counted so), then
    changed to one hash (fqn 'a', offsets that differ by multiples of 2**61 - 1): by filling
    their attribute dicts after the BUILD, or by a second BUILD; then all made keys of one dict."""
    out = bytearray(b"\x80\x04")
    memo = 0

    def memoize() -> int:
        nonlocal memo
        out.extend(b"\x94")
        memo += 1
        return memo - 1

    def get(k: int) -> None:
        out.extend(b"j" + struct.pack("<I", k))

    def text(t: str) -> None:
        out.extend(b"\x8c" + bytes([len(t)]) + t.encode())

    def long1(v: int) -> None:
        b = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
        out.extend(b"\x8a" + bytes([len(b)]) + b)

    text("torch.distributed.checkpoint.metadata")
    text("MetadataIndex")
    out.extend(b"\x93")
    cls = memoize()
    text("fqn")
    fqn = memoize()
    text("offset")
    offset = memoize()
    objs, dicts = [], []
    for i in range(n):
        get(cls)
        out.extend(b")\x81")
        objs.append(memoize())
        out.extend(b"}")
        dicts.append(memoize())
        get(fqn)
        text(f"k{i}")
        out.extend(b"sb0")  # SETITEM, BUILD, POP
    for i in range(n):
        if second_build:
            get(objs[i])
            out.extend(b"}")
        else:
            get(dicts[i])
        out.extend(b"(")
        get(fqn)
        text("a")
        get(offset)
        long1(7 + (i + 1) * M)
        out.extend(b"ub0" if second_build else b"u0")
    out.extend(b"}(")
    for i in range(n):
        get(objs[i])
        out.extend(b"N")
    return bytes(out + b"u.")


@pytest.mark.parametrize("second_build", [False, True], ids=["fields-changed-after-build", "second-build"])
def test_metadata_index_fields_cannot_change_after_they_were_counted(second_build):
    """``storage_data`` keys are counted by their hash as ``BUILD`` gives them their fields. A
    ``.metadata`` that then changed the fields (the attribute dict filled after the ``BUILD``, or
    a second ``BUILD``) made 6,000 keys of one hash: 6.9 s. DCP builds each object once, from a
    complete dict: anything else is refused by name."""
    from distckpt.integrity.safe_pickle import load_metadata

    data = _metadata_index_pickle(6000, second_build)
    words = "a BUILD already gave attributes" if second_build else "changes a dict after BUILD"
    with pytest.raises(UnsafeCheckpointError, match=words):
        refuse_work_bombs(data, "x", strict=True)
    with pytest.raises(UnsafeCheckpointError, match=words):
        load_metadata(data, "x")


def _newobj_keys(cls: str, args: list[bytes]) -> bytes:
    """``{cls.__new__(cls, *a): None for a in args}`` by ``NEWOBJ`` (protocol 2), as torch's
    ``weights_only`` unpickler admits it for the classes on its allow-list."""
    out = b"\x80\x02c" + cls.replace(" ", "\n").encode() + b"\nq\x00}q\x01("
    for a in args:
        out += b"h\x00" + a + b"\x81N"
    return out + b"u."


def test_newobj_of_value_hashed_classes_is_counted():
    """``NEWOBJ`` of ``torch.Size`` or ``complex`` makes objects hashed by value, as ``REDUCE``
    does: 14,000 sizes of one hash took 3.4 s through torch's loader, complex numbers 2.6 s."""
    pairs = _crafted_pairs(3000)

    def long1(v: int) -> bytes:
        b = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
        return b"\x8a" + bytes([len(b)]) + b

    sizes = _newobj_keys("torch Size", [long1(a) + long1(b) + b"\x86\x85" for a, b in pairs])
    assert len({hash(k) for k in pickle.loads(sizes)}) == 1
    complexes = _newobj_keys("builtins complex", [b"G" + struct.pack(">d", 1000003.0 * k) + b"G" + struct.pack(">d", -k) + b"\x86" for k in range(2, 3000)])
    assert len({hash(k) for k in pickle.loads(complexes)}) == 1
    for data in (sizes, complexes):
        with pytest.raises(UnsafeCheckpointError, match="keys whose hashes collide"):
            refuse_work_bombs(data, "x")


def test_ordered_dicts_from_a_tuple_of_pairs_are_counted():
    """``OrderedDict(tuple_of_pairs)`` and a ``BUILD`` of such a tuple onto an ``OrderedDict``
    (torch's loader then updates its ``__dict__`` with it) insert the pairs' first members:
    12,000 of one hash took 4.1 s."""
    pairs = [(k * M, i) for i, k in enumerate(range(1, 3000))]
    called = pickle.dumps(hash_flood_job._Call(collections.OrderedDict, tuple(pairs)), protocol=2)
    body = b"".join(b"\x8a\x0c" + a.to_bytes(12, "little", signed=True) + b"J" + struct.pack("<i", i) + b"\x86" for a, i in pairs)
    built = b"\x80\x02ccollections\nOrderedDict\n)R(" + body + b"tb."
    for data in (called, built):
        with pytest.raises(UnsafeCheckpointError, match="keys whose hashes collide"):
            refuse_work_bombs(data, "x")


def test_a_set_of_pairs_sharing_a_first_member_is_no_collision():
    """No false alarm: ``torch.save`` writes a set as ``set([...])``; pairs sharing their first
    member are distinct members of distinct hashes (the first version charged their first
    members, meant for ``OrderedDict(pairs)``, and refused these)."""
    for value in ({(0, f"p{i}") for i in range(5000)}, {(layer, i) for layer in range(4) for i in range(1250)}):
        data = pickle.dumps(value, protocol=2)
        assert refuse_work_bombs(data, "x") < 4 * len(data)


def test_the_decoder_charges_copies_of_one_shared_payload():
    """Thousands of encoded values sharing one payload (memo) each decode into a copy of their
    own: 2,000 sets of one 5,000-member payload (45 KB) took 4.6 s and 0.9 GB. Copies after the
    first are charged; empty payloads (one shared ``()``) cost nothing."""
    payload = tuple(range(5000))
    value = [(MARKER, "set", payload) for _ in range(2000)]
    with pytest.raises(IntegrityError, match="share one payload"):
        decode_loaded(value, "k")
    empties = [(MARKER, "set", ()) for _ in range(100_000)]
    out = decode_loaded(empties, "k")
    assert len(out) == 100_000 and out[0] == set() and out[0] is not out[1]


# --- Found by a second attacker's review -----------------------------------------------------------


def _long1(v: int) -> bytes:
    b = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(b)]) + b


class _Sub(torch.Tensor):
    """A tensor subclass (torch.save writes it with _rebuild_from_type_v2)."""


@pytest.mark.parametrize("func", [b"builtins\nset\n", b"collections\nCounter\n", b"builtins\nbytearray\n"])
def test_rebuild_from_type_takes_only_a_tensor_rebuild(func):
    """torch's allow-list admits ``_rebuild_from_type_v2(func, new_type, args, state)``, which
    calls ``func(*args)``: ``set`` of 20,000 colliding integers took 4.6 s that way, a
    ``bytearray`` of 1 GB came from 79 bytes. ``torch.save`` gives it one of torch's tensor
    rebuilds (a tensor subclass); anything else is refused by name."""
    from distckpt.integrity.call_scan import refuse_argument_bombs

    items = b"".join(_long1(7 + k * M) for k in range(1, 2000)) if b"bytearray" not in func else b""
    arg = b"](" + items + b"e\x85" if items else b"J\x00\xca\x9a\x3b\x85"
    data = b"\x80\x02ctorch._tensor\n_rebuild_from_type_v2\n(c" + func + b"c" + func + arg + b"NtR."
    with pytest.raises(UnsafeCheckpointError, match="_rebuild_from_type_v2 with .* where torch.save gives it one of torch's tensor rebuilds"):
        refuse_argument_bombs(data, "x")
    buf = io.BytesIO()
    torch.save(torch.zeros(2).as_subclass(_Sub), buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        legit = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    assert b"_rebuild_from_type_v2" in legit
    refuse_argument_bombs(legit, "x")  # what torch.save writes for a tensor subclass passes


def test_a_list_of_pairs_built_onto_an_ordered_dict_is_counted():
    """A ``BUILD`` of a list of pairs onto an ``OrderedDict`` or a ``Counter`` (torch's loader
    updates its ``__dict__`` with it) inserts their first members: 16,000 of one hash, 2.6 s."""
    for cls in (b"collections\nOrderedDict\n", b"collections\nCounter\n"):
        body = b"".join(_long1(7 + k * M) + b"K\x01\x86" for k in range(1, 3000))
        data = b"\x80\x02c" + cls + b")R](" + body + b"eb."
        with pytest.raises(UnsafeCheckpointError, match="keys whose hashes collide"):
            refuse_work_bombs(data, "x")


def test_a_tuple_holding_what_the_model_does_not_know_is_not_known_either():
    """``complex`` numbers (and ``torch.Size`` of a list) share one model hash; a tuple key
    ``(k, complex_k)`` got one of its own for each ``k``, yet ``complex(X % 1000003, X // 1000003)``
    hashes to ``X``: 20,000 keys of one real hash took 6.6 s. Such tuples count as colliding too."""
    pairs = _crafted_pairs(2999)  # (a, b) of one tuple hash; complex(b % 1000003, b // 1000003) hashes to b
    value = {(a, complex(b % 1000003, b // 1000003)): 0 for a, b in pairs}
    assert len({hash(k) for k in value}) == 1
    with pytest.raises(UnsafeCheckpointError, match="keys whose hashes collide"):
        refuse_work_bombs(pickle.dumps(value, protocol=2), "x")


def test_a_key_that_decodes_unhashable_is_an_integrity_error():
    """A dict key holding an encoded set is hashable as stored and not once decoded: a plain
    ``TypeError`` escaped the decoder; now it is the decoder's named error."""
    inner = (MARKER, "set", (1,))
    for value in ({("a", inner): 1}, (MARKER, "set", (("a", inner),))):
        with pytest.raises(IntegrityError, match="cannot be hashed"):
            decode_loaded(value, "k")


# --- Found by a third attacker's review ---------------------------------------------------------


def test_a_list_of_pairs_as_build_state_with_slots_is_counted():
    """torch's loader reads a ``BUILD`` state ``(state, slotstate)`` and updates ``__dict__``
    with ``state``: a list of 16,000 pairs of one key hash onto a ``Counter`` took 5.9 s."""
    body = b"".join(_long1(7 + k * M) + b"K\x01\x86" for k in range(1, 3000))
    data = b"\x80\x02ccollections\nCounter\n)R](" + body + b"eN\x86b."
    with pytest.raises(UnsafeCheckpointError, match="keys whose hashes collide"):
        refuse_work_bombs(data, "x")


def test_a_bit_generator_state_cannot_repeat_its_storage():
    """NumPy copies the state it is given: an SFC64 state holding a stride-0 view of one element
    (a 1.7 KB record) took 1.5 GB for 200M elements before NumPy refused it. Refused first."""
    view = torch.zeros(1, dtype=torch.int64).expand(100_000_000)
    state = {"bit_generator": "SFC64", "state": {"state": view}, "has_uint32": 0, "uinteger": 0}
    with pytest.raises(IntegrityError, match="repeats its storage"):
        decode_loaded((MARKER, "numpy.random.Generator", ("SFC64", state)), "k")
    with pytest.raises(IntegrityError, match="repeats its storage"):
        decode_loaded((MARKER, "numpy.random.RandomState", {"bit_generator": "MT19937", "state": {"key": view, "pos": 0}}), "k")
    real = np.random.default_rng(3)
    encoded = encode_for_save({"g": (real,)})["g"]
    assert decode_loaded(encoded, "g")[0].bit_generator.state == real.bit_generator.state


@pytest.mark.parametrize(
    "pickled, raised",
    [
        (b"\x80\x02cbuiltins\nset\nK\x05\x85R.", "TypeError"),
        (b"\x80\x02ctorch\ndevice\nX\x04\x00\x00\x00nope\x85R.", "RuntimeError"),
        (b"\x80\x02cbuiltins\ncomplex\nX\x02\x00\x00\x00zz\x85R.", "ValueError"),
    ],
)
def test_what_torch_load_raises_is_named_as_an_integrity_error(pickled, raised):
    """An admitted call given arguments it refuses raised a bare ``TypeError``, ``RuntimeError``
    or ``ValueError`` out of every reader of value records; now an ``IntegrityError`` naming
    the record."""
    from distckpt.integrity.deep_stack import torch_load

    buf = io.BytesIO()
    torch.save({}, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z, io.BytesIO() as out:
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as w:
            for info in z.infolist():
                w.writestr(info, pickled if info.filename.endswith("data.pkl") else z.read(info.filename))
        record = out.getvalue()
    with pytest.raises(IntegrityError, match=f"value 'x' is not a record torch.load reads: {raised}"):
        torch_load(io.BytesIO(record), record, "value 'x'")
