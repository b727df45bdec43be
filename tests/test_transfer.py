"""The local tier's file transfer between ranks (``distckpt.storage.transfer``): files in pieces
and waves, exact bytes, and never a file under its final name that did not arrive whole and
intact. Two real gloo ranks; small ``PIECE``/``WAVE`` so that a few MiB take many waves."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from dist_harness import run_ranks
from distckpt.integrity.manifest import FileRecord, Manifest, digest_of
from distckpt.storage import transfer as tr

FILES = {"big.distcp": 5 * 2**20 + 123, "empty.distcp": 0, "small.distcp": 4097, "other.distcp": 2**20}


def _payload(name: str, size: int) -> bytes:
    return random.Random(name).randbytes(size)


def _manifest(checksums: bool = True, wrong: str | None = None) -> Manifest:
    files = {}
    for name, size in FILES.items():
        data = _payload(name, size)
        digest = digest_of(data, "crc32c") if checksums else None
        if name == wrong:
            digest = digest_of(data + b"x", "crc32c")
        files[name] = FileRecord(size, digest)
    return Manifest(step=1, world_size=2, entries={}, files=files, checksum_algorithm="crc32c" if checksums else None, torch_version="", distckpt_version="")


def _body(rank: int, world: int, base: str, scenario: str) -> tuple[list[str], dict[str, bytes], list[str]]:
    from distckpt._dist import Group

    tr.PIECE, tr.WAVE = 256 * 1024, 3 * 256 * 1024  # many pieces, many waves
    here = Path(base) / f"rank{rank}"
    here.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        for name, size in FILES.items():
            (here / name).write_bytes(_payload(name, size))
    manifest = _manifest(checksums=scenario != "no-checksums", wrong="small.distcp" if scenario == "checksum" else None)
    if scenario == "symlink" and rank == 0:
        os.replace(here / "other.distcp", here / "real")
        os.symlink(here / "real", here / "other.distcp")
    if scenario == "fifo" and rank == 0:  # opening it must not wait for a writer
        os.unlink(here / "other.distcp")
        os.mkfifo(here / "other.distcp")
    if scenario in ("read-fails", "read") and rank == 0:
        tr.map_file = lambda fd, size: None  # the pieces are read (preadv), not sent from a mapping
    if scenario == "read-fails" and rank == 0:
        real = tr._read_piece

        def failing(fd, piece, into):  # the third piece of big.distcp cannot be read
            return False if piece.move == 0 and piece.offset == 2 * tr.PIECE else real(fd, piece, into)

        tr._read_piece = failing
    if scenario == "no-memory" and rank == 1:  # the receiver fails before posting anything

        def no_memory(self, slot, start, length):
            raise MemoryError("no buffer")

        tr._Pools.host = no_memory
    moves = [(name, 0, 1) for name in FILES]
    problems = tr.transfer(Group(), str(here), moves, manifest, verify=scenario != "sizes-only")
    got = {p.name: p.read_bytes() for p in sorted(here.iterdir()) if p.is_file() and not p.is_symlink()}  # is_file: no FIFO
    return problems, got if rank == 1 else {}, sorted(os.listdir(here))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", ["ok", "read", "sizes-only", "no-checksums"])
def test_files_arrive_exactly_in_many_pieces_and_waves(tmp_path, scenario):
    results = run_ranks(_body, 2, tmp_path, str(tmp_path / "dirs"), scenario, timeout=100)
    assert results[0][0] == [] and results[1][0] == [], results
    got = results[1][1]
    assert set(got) == set(FILES)
    for name, size in FILES.items():
        assert got[name] == _payload(name, size), name
    assert not [n for n in results[1][2] if n.endswith(".part")]


@pytest.mark.timeout(120)
def test_a_file_failing_its_checksum_is_never_kept(tmp_path):
    problems, got, names = run_ranks(_body, 2, tmp_path, str(tmp_path / "dirs"), "checksum", timeout=100)[1]
    assert "small.distcp" not in got and "small.distcp.part" not in names
    assert any("small.distcp" in p and "checksum" in p for p in problems), problems
    assert got["big.distcp"] == _payload("big.distcp", FILES["big.distcp"])  # the others arrive


@pytest.mark.timeout(120)
def test_a_read_failure_half_way_keeps_no_file_and_no_part(tmp_path):
    results = run_ranks(_body, 2, tmp_path, str(tmp_path / "dirs"), "read-fails", timeout=100)
    (sent_problems, _, _), (problems, got, names) = results
    assert any("big.distcp" in p for p in sent_problems), sent_problems
    assert any("big.distcp" in p and "could not read" in p for p in problems), problems
    assert "big.distcp" not in got and not [n for n in names if n.endswith(".part")]
    assert got["other.distcp"] == _payload("other.distcp", FILES["other.distcp"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", ["symlink", "fifo"])
def test_a_file_that_is_not_regular_is_skipped_by_both_ends(tmp_path, scenario):
    (sent_problems, _, _), (problems, got, names) = run_ranks(_body, 2, tmp_path, str(tmp_path / "dirs"), scenario, timeout=60)
    assert any("other.distcp" in p for p in sent_problems), sent_problems
    assert "other.distcp" not in got and "other.distcp.part" not in names
    assert got["big.distcp"] == _payload("big.distcp", FILES["big.distcp"])


def test_waves_bound_each_ranks_bytes_and_pieces_cover_each_file():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([0, 1, tr.PIECE - 1, tr.PIECE, tr.PIECE + 1, rng.randrange(5 * tr.PIECE)]) for _ in range(rng.randrange(1, 8))]
        moves = [(f"f{i}", rng.randrange(4), rng.randrange(4)) for i in range(len(sizes))]
        pieces = tr._pieces(sizes)
        for i, size in enumerate(sizes):
            mine = sorted((p.offset, p.length) for p in pieces if p.move == i)
            assert sum(n for _, n in mine) == size and all(0 < n <= tr.PIECE for _, n in mine if size)
            assert all(a + n == b for (a, n), (b, _) in zip(mine, mine[1:]))
        waves = tr._waves(pieces, moves)
        assert [p for w in waves for p in w.pieces] == pieces  # in order: a file's pieces arrive in order
        for w in waves:
            per_rank: dict[int, int] = {}
            for p in w.pieces:
                for r in moves[p.move][1:]:
                    per_rank[r] = per_rank.get(r, 0) + p.length
            assert max(per_rank.values()) <= tr.WAVE


@pytest.mark.timeout(120)
def test_an_unexpected_error_on_one_rank_is_reported_on_both_and_keeps_nothing(tmp_path):
    """The receiver raises (no memory for a buffer) before it posted a receive: no exception
    escapes, no collective is left unmatched; both ranks report the failure."""
    results = run_ranks(_body, 2, tmp_path, str(tmp_path / "dirs"), "no-memory", timeout=100, pg_timeout=8)
    for problems, _, _ in results:
        assert any(p.startswith("transfer with a peer failed") for p in problems), problems
    assert any("no buffer" in p for p in results[1][0]), results[1][0]  # its own reason, at least
    assert results[1][1] == {} and not [n for n in results[1][2] if n.endswith(".part")]
