"""Attacks on the local tier's file transfer (distckpt.storage.transfer) and the recovery's reuse
of each node's ``.metadata`` (Checkpointer._load_local, load(preread=...)). Real gloo ranks via
run_ranks; small PIECE/WAVE so a few KiB take several pieces."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest

from dist_harness import run_ranks
from distckpt.integrity.manifest import FileRecord, Manifest, digest_of
from distckpt.storage import transfer as tr

pytestmark = [
    pytest.mark.xdist_group("transfer_attack"),
    pytest.mark.filterwarnings("ignore:distckpt:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning"),
]

SIZE = 40_000


def _data(name: str, size: int = SIZE, salt: str = "") -> bytes:
    return random.Random(name + salt).randbytes(size)


def _manifest(names: dict[str, int], checksums: bool = True) -> Manifest:
    files = {n: FileRecord(s, digest_of(_data(n, s), "crc32c") if checksums else None) for n, s in names.items()}
    return Manifest(step=1, world_size=2, entries={}, files=files, checksum_algorithm="crc32c" if checksums else None, torch_version="", distckpt_version="")


def _listing(here: Path) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {}
    for p in sorted(here.iterdir()):
        if p.is_symlink():
            out[p.name] = "symlink"
        elif p.is_dir():
            out[p.name] = "dir"
        elif p.is_file():
            out[p.name] = p.read_bytes()
    return out


def _body(rank: int, world: int, base: str, scenario: str):
    from distckpt._dist import Group

    tr.PIECE, tr.WAVE = 4096, 3 * 4096
    here = Path(base) / f"rank{rank}"
    here.mkdir(parents=True, exist_ok=True)
    names = {"a.distcp": SIZE, "z.distcp": 0}
    checksums = scenario not in ("self-move-nochecksum", "truncated-before-map-sizes-only")
    verify = scenario not in ("self-move-nochecksum", "truncated-before-map-sizes-only")
    moves = [(n, 0, 1) for n in names]
    if rank == 0 or (scenario == "dup-senders" and rank == 1):
        for n, s in names.items():
            (here / n).write_bytes(_data(n, s, salt="bad" if (scenario == "dup-senders" and rank == 1) else ""))
    if scenario == "dup-senders":  # the same file to rank 2 from rank 0 (intact) and rank 1 (damaged, same size)
        moves = [("a.distcp", 0, 2), ("a.distcp", 1, 2)]
    if scenario == "dup-same-sender":
        moves = [("a.distcp", 0, 1), ("a.distcp", 0, 1)]
    if scenario.startswith("self-move"):  # rank 0 "sends" its own file to itself
        moves = [("a.distcp", 0, 0)]
    if scenario == "both-ways":
        (here / f"r{rank}.distcp").write_bytes(_data(f"r{rank}.distcp"))
        names = {**names, "r0.distcp": SIZE, "r1.distcp": SIZE}
        moves = [("r0.distcp", 0, 1), ("r1.distcp", 1, 0), ("z.distcp", 0, 1)]
    if scenario.startswith("truncated-before-map") and rank == 0:
        real_map = tr.map_file

        def shrink_then_map(fd, size):  # the file shrinks after the sender opened and checked it
            os.truncate(here / "a.distcp", SIZE // 2)
            return real_map(fd, size)

        tr.map_file = shrink_then_map
    if scenario == "truncated-before-read" and rank == 0:
        tr.map_file = lambda fd, size: None
        os_open = tr.open_regular

        def open_then_shrink(path, size):
            fd = os_open(path, size)
            os.truncate(path, size // 2)
            return fd

        tr.open_regular = open_then_shrink
    if scenario == "part-hardlink" and rank == 1:  # a leftover name.part hard-linked to another file
        (here / "precious").write_bytes(b"keep me" * 100)
        os.link(here / "precious", here / "a.distcp.part")
    if scenario == "part-symlink" and rank == 1:
        (here / "precious").write_bytes(b"keep me" * 100)
        os.symlink(here / "precious", here / "a.distcp.part")
    if scenario == "part-dir" and rank == 1:
        (here / "a.distcp.part").mkdir()
    if scenario == "final-is-dir" and rank == 1:
        (here / "a.distcp").mkdir()
        (here / "a.distcp" / "inside").write_bytes(b"x")
    if scenario == "not-a-dir" and rank == 1:
        shutil.rmtree(here)
        here.write_bytes(b"a file where the directory should be")
    if scenario == "many-small":
        names = {f"s{i:03d}.distcp": i % 7 for i in range(150)}
        if rank == 0:
            for n, s in names.items():
                (here / n).write_bytes(_data(n, s))
        moves = [(n, 0, 1) for n in names]
    if scenario == "sender-lacks":
        names = {**names, "ghost.distcp": 10}
        moves = [("ghost.distcp", 0, 1), *moves]
    manifest = _manifest(names, checksums)
    problems = tr.transfer(Group(), str(here), moves, manifest, verify=verify)
    listing = _listing(here) if here.is_dir() else {}
    return problems, listing


def _run(tmp_path, scenario, world=2):
    return run_ranks(_body, world, tmp_path, str(tmp_path / "dirs"), scenario, timeout=90, pg_timeout=20)


def _no_part(listing):
    return not [n for n, v in listing.items() if n.endswith(".part") and v not in ("dir", "symlink")]


@pytest.mark.timeout(120)
def test_duplicate_moves_from_two_senders_never_keep_the_damaged_copy(tmp_path):
    """Two moves of one file to one rank (rank 0's intact copy, rank 1's damaged one of the same
    size): the file kept under its final name must be the intact bytes, or none at all."""
    results = _run(tmp_path, "dup-senders", world=3)
    problems, listing = results[2]
    if "a.distcp" in listing:
        assert listing["a.distcp"] == _data("a.distcp"), f"damaged bytes kept under the final name; problems: {problems}"
    assert _no_part(listing)


@pytest.mark.timeout(120)
def test_duplicate_moves_from_one_sender_arrive_without_a_spurious_problem(tmp_path):
    """The same move twice (same sender, same bytes): the file arrives intact, and no problem is
    reported for a file that did arrive (a spurious problem fails a whole recovery)."""
    problems, listing = _run(tmp_path, "dup-same-sender")[1]
    assert listing.get("a.distcp") == _data("a.distcp")
    assert problems == [], problems


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", ["self-move", "self-move-nochecksum"])
def test_a_move_to_the_sender_itself_never_destroys_its_file(tmp_path, scenario):
    """(passes) A move (file, 0, 0): rank 0 already holds the file. It must end with its bytes intact
    (never an empty .part renamed over it), no hang, no escaping exception, no .part left."""
    problems, listing = _run(tmp_path, scenario)[0]
    assert listing.get("a.distcp") == _data("a.distcp"), f"the sender's own file was replaced; problems: {problems}"
    assert _no_part(listing)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", ["truncated-before-map-sizes-only"])
def test_a_file_truncated_after_the_open_check_is_reported_not_kept_nor_crashing(tmp_path, scenario):
    """The sender's file shrinks between its open (size checked) and its mapping: short pieces go
    on the wire. The transfer must report it (the sender knows its mapping is short) and keep
    nothing under the final name, also without checksums (verify=False: sizes only)."""
    (sent, _), (problems, listing) = _run(tmp_path, scenario)
    assert "a.distcp" not in listing and _no_part(listing)
    assert any("a.distcp" in p for p in problems), problems
    assert listing.get("z.distcp") == b"" or any("transfer with a peer failed" in p for p in problems)


@pytest.mark.timeout(120)
def test_truncated_file_mapped_with_checksums_is_not_kept(tmp_path):
    """(passes) The same shrink before the mapping, with checksums: the receiver's check refuses it
    (the sender itself reports nothing)."""
    (sent, _), (problems, listing) = _run(tmp_path, "truncated-before-map")
    assert "a.distcp" not in listing and _no_part(listing)
    assert any("a.distcp" in p for p in problems), problems


@pytest.mark.timeout(120)
def test_truncated_file_read_path(tmp_path):
    """(passes) Same with the preadv path: the short read is reported, nothing kept."""
    (sent, _), (problems, listing) = _run(tmp_path, "truncated-before-read")
    assert any("a.distcp" in p for p in sent) and any("a.distcp" in p for p in problems)
    assert "a.distcp" not in listing and _no_part(listing)
    assert listing["z.distcp"] == b""


@pytest.mark.timeout(120)
def test_a_leftover_hardlinked_part_is_not_written_through(tmp_path):
    """``a.distcp.part`` left as a hard link to another file of the node: receiving must not
    truncate and overwrite that other file (O_NOFOLLOW stops symbolic links only)."""
    problems, listing = _run(tmp_path, "part-hardlink")[1]
    assert listing.get("precious") == b"keep me" * 100, "another file was overwritten through a hard-linked .part"
    assert listing.get("a.distcp") == _data("a.distcp")


@pytest.mark.timeout(120)
def test_a_leftover_part_symlink_is_replaced_not_followed(tmp_path):
    """A leftover ``a.distcp.part`` that is a symbolic link: unlinked, never written through (the
    target untouched); the file then arrives intact."""
    problems, listing = _run(tmp_path, "part-symlink")[1]
    assert listing["precious"] == b"keep me" * 100
    assert problems == [] and listing["a.distcp"] == _data("a.distcp")
    assert listing["z.distcp"] == b""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", ["part-dir", "final-is-dir", "not-a-dir", "sender-lacks"])
def test_obstacles_are_reported_and_nothing_partial_kept(tmp_path, scenario):
    """(passes) A directory named ``a.distcp.part`` or ``a.distcp``, a file where the receiver's
    directory should be, a file the sender lacks: reported, no bytes under a final name that did
    not arrive, no .part left, the other files still arrive."""
    (sent, _), (problems, listing) = _run(tmp_path, scenario)
    assert problems or sent
    if scenario == "sender-lacks":
        assert "ghost.distcp" not in listing and listing["a.distcp"] == _data("a.distcp")
    elif scenario == "final-is-dir":
        assert listing["a.distcp"] == "dir" and listing["z.distcp"] == b""
    elif scenario == "part-dir":
        assert "a.distcp" not in listing and listing["z.distcp"] == b""
    assert _no_part(listing)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", ["both-ways", "many-small"])
def test_both_ways_and_many_small_files(tmp_path, scenario):
    """(passes) Ranks that both send and receive in one wave; 150 tiny and empty files."""
    results = _run(tmp_path, scenario)
    assert results[0][0] == [] and results[1][0] == [], results
    if scenario == "both-ways":
        assert results[1][1]["r0.distcp"] == _data("r0.distcp") and results[0][1]["r1.distcp"] == _data("r1.distcp")
        assert results[1][1]["z.distcp"] == b""
    else:
        got = results[1][1]
        for i in range(150):
            n = f"s{i:03d}.distcp"
            assert got[n] == _data(n, i % 7), n
    assert all(_no_part(r[1]) for r in results)


# -- recovery: each node's .metadata read while planning (load(preread=...)) -------------------
def _ckpt_body(rank: int, world: int, root: str, nodes: str, scenario: str, kw: dict):
    import torch
    import torch.distributed as dist

    import distckpt

    os.environ["LOCAL_WORLD_SIZE"] = "1"  # two simulated nodes of one rank
    local = f"{nodes}/node{rank}"

    def model(v):
        m = torch.nn.Linear(8, 4)
        with torch.no_grad():
            m.weight.fill_(v)
            m.bias.fill_(v)
        return m

    with distckpt.Checkpointer(root, local_dir=local, **kw) as ckpt:
        ckpt.save(1, {"model": model(1.0), "step": 1})
        ckpt.save(2, {"model": model(2.0), "step": 2})
    dist.barrier()
    if rank == 0:
        step_dir = "step_000000002"
        victim = Path(nodes) / ("node1" if scenario == "node1" else "node0") / step_dir / ".metadata"
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        os.rename(root, root + ".away")  # only the tier can serve the load
    dist.barrier()
    out = []
    for _ in range(3):  # the first, second and third recovery in a row
        state = {"model": model(-1.0), "step": -1}
        try:
            with distckpt.Checkpointer(root, local_dir=local, **kw) as ckpt:
                got = ckpt.load(state)
                tier = ckpt.last_load_report.tier
            out.append((got, state["step"], float(state["model"].weight[0, 0]), float(state["model"].bias[3]), tier))
        except Exception as exc:  # noqa: BLE001
            out.append(("error", type(exc).__name__, str(exc)[:200]))
        dist.barrier()
    leftovers = sorted(str(p) for p in Path(local).rglob("*.part"))
    return out, leftovers


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "scenario,kw",
    [("node1", {}), ("node1", {"verify": False}), ("node1", {"checksum": None}), ("node0", {}), ("node0", {"verify": False})],
    ids=["node1", "node1-verify-off", "node1-no-checksums", "node0", "node0-verify-off"],
)
def test_damaged_metadata_on_one_node_three_recoveries_in_a_row(tmp_path, scenario, kw):
    """(passes) Node 1's (or the coordinator's node 0's) ``.metadata`` is damaged (same size) and
    the root is away: every one of three recoveries in a row loads step 2's exact values on both
    ranks from the local tier, alike on every rank, without leftovers."""
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    results = run_ranks(_ckpt_body, 2, tmp_path, str(root), str(nodes), scenario, kw, timeout=200, pg_timeout=30)
    for out, leftovers in results:
        assert out == [(2, 2, 2.0, 2.0, "local")] * 3, out
        assert leftovers == []
