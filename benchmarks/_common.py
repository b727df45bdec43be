"""Helpers shared by the benchmark scripts: state generation, peak-memory probes, rank spawning.

Not part of the library. Every rank body is a module-level function so it can be spawned.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))


def chosen_on_pythonpath() -> bool:
    """Whether ``PYTHONPATH`` names a tree holding a distckpt: then that one is measured (e.g. an
    older commit's worktree for a before/after run), not this checkout's. Putting the checkout
    first regardless made such runs measure the checkout twice."""
    return any((Path(p) / "distckpt" / "__init__.py").is_file() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)


if str(REPO) not in sys.path and not chosen_on_pythonpath():
    sys.path.insert(0, str(REPO))

MiB = 1024 * 1024
GiB = 1024 * MiB
#: Where the published (committed) measurements live: only a full run the user asked for writes here.
RESULTS = REPO / "benchmarks" / "results"


# ------------------------------------------------------------------------------------------
# command-line values: a bad one is a usage error naming its flag (exit 2), not a traceback
# later or an empty table. argparse prefixes an ArgumentTypeError's message with the flag.
def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An ``int`` >= 1 (repeats, world sizes, threads, ...)."""
    return _int_at_least(text, 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    """An ``int`` >= 0 (where 0 means "none", e.g. ``--unprepared-repeats 0``)."""
    return _int_at_least(text, 0, "an integer >= 0")


def positive_float(text: str) -> float:
    """A finite ``float`` > 0 (sizes): nan and inf would build no state or never finish."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


def positive_ints(text: str, *, allow_empty: bool = False) -> list[int]:
    """Comma-separated positive ints (``"1,2"``); an empty list only where ``allow_empty`` (a
    flag whose ``''`` means "skip this part")."""
    parts = [x.strip() for x in text.split(",")] if text.strip() else []
    if not parts and not allow_empty:
        raise argparse.ArgumentTypeError("expected comma-separated positive integers, got ''")
    try:
        return [positive_int(x) for x in parts]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None


def positive_ints_or_none(text: str) -> list[int]:
    """:func:`positive_ints`, ``''`` allowed (an empty list)."""
    return positive_ints(text, allow_empty=True)


def choice_list(choices: tuple[str, ...], *, allow_empty: bool = False) -> Callable[[str], list[str]]:
    """An argparse ``type``: comma-separated names, each one of ``choices`` (a typo is a usage
    error, not a silently empty or mislabelled measurement), in the order given, no repeats."""

    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in names if x not in choices]
        if bad or (not names and not allow_empty) or len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(choices)} (each once), got {text!r}")
        return names

    parse.__name__ = "choice list"
    return parse


def existing_dir(text: str) -> str:
    """A directory that exists: the scripts work in a folder of their own made inside it and
    remove only that, so a mistyped path is refused rather than created. A folder inside a
    checkpoint step (one holding ``manifest.json`` or ``.metadata``, itself or above) is refused
    too: the raw-I/O rows wrote there before distckpt's own save refused the root."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"not an existing directory: {text!r}")
    for folder in (path.resolve(), *path.resolve().parents):
        # DCP's .metadata in any folder; manifest.json (a common name: web apps, extensions)
        # only in a step folder's name.
        marks = (".metadata", "manifest.json") if re.fullmatch(r"step_\d+", folder.name) else (".metadata",)
        for mark in marks:
            if (folder / mark).is_file():
                raise argparse.ArgumentTypeError(f"{text!r} lies inside the checkpoint step {str(folder)!r} (it holds {mark}): pass a folder outside it")
    return text


def add_json_arg(p: argparse.ArgumentParser, name: str, *aliases: str) -> None:
    """The ``--json`` option every script takes (its results, the table beside them as .md),
    filled by :func:`resolve_outputs` when not given."""
    p.add_argument("--json", *aliases, dest="json", default=None,
                   help=f"results (and the table as .md beside it); default benchmarks/results/{name}.json, "
                        "with --quick a new temporary folder")  # fmt: skip


def resolve_quick(args: argparse.Namespace, full: dict[str, Any], quick: dict[str, Any]) -> None:
    """Fill every option the user left out (parsed as ``None``) with its ``--quick`` value or its
    full-run default: ``--quick`` only changes defaults, never a value given on the command line."""
    for name, value in ({**full, **quick} if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def resolve_outputs(args: argparse.Namespace, name: str, *, png: bool = False) -> None:
    """Fill ``args.json`` (and ``args.png``) when not given: a full run publishes to
    ``benchmarks/results/<name>.json``; a ``--quick`` run (a smoke run, not a measurement) to a
    new temporary folder, printed, so that it never overwrites the committed results the README
    quotes. The plot follows the JSON (same stem, ``.png``); ``--json ''`` writes neither."""
    if args.json is None:
        if args.quick:
            args.json = str(Path(tempfile.mkdtemp(prefix=f"distckpt-bench-{name}-")) / f"{name}.json")
            print(f"[{name}] --quick without --json: results go to {args.json}", flush=True)
        else:
            args.json = str(RESULTS / f"{name}.json")
    if args.json:
        _refuse_clobbering_json(args.json, png)
    if png and args.png is None:
        args.png = str(Path(args.json).with_suffix(".png")) if args.json else ""


def _refuse_clobbering_json(text: str, png: bool) -> None:
    """A ``--json`` path whose table (``.md``) or plot (``.png``) would be itself, or that names a
    folder: refused before the run (after it, the table overwrote the results, or the write
    failed with a traceback once the whole run had been spent)."""
    path = Path(text)
    why = None
    if text.endswith(("/", os.sep)) or path.is_dir():
        why = "is a folder; name a file (e.g. DIR/results.json)"
    elif path.suffix == ".md" or (png and path.suffix == ".png"):
        why = f"would be overwritten by the {path.suffix} written beside it; name a .json file"
    if why is not None:
        print(f"error: --json {text!r} {why}", file=sys.stderr)
        raise SystemExit(2)


# ------------------------------------------------------------------------------------------
# peak resident memory
def reset_peak_rss() -> int:
    """Reset this process's VmHWM (Linux ``clear_refs`` 5) and return the current RSS in bytes."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return current_rss()


def current_rss() -> int:
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    """Peak RSS since the last :func:`reset_peak_rss` (bytes)."""
    return _status_kib("VmHWM") * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


# ------------------------------------------------------------------------------------------
# state
def layer_shapes(prefix: str, d: int) -> list[tuple[str, tuple[int, ...]]]:
    """One GPT block of width ``d``: four matrices (qkv, out, mlp up/down) and eight vectors."""
    return [
        (f"{prefix}.ln1.weight", (d,)), (f"{prefix}.ln1.bias", (d,)),
        (f"{prefix}.attn.qkv.weight", (3 * d, d)), (f"{prefix}.attn.qkv.bias", (3 * d,)),
        (f"{prefix}.attn.out.weight", (d, d)), (f"{prefix}.attn.out.bias", (d,)),
        (f"{prefix}.ln2.weight", (d,)), (f"{prefix}.ln2.bias", (d,)),
        (f"{prefix}.mlp.up.weight", (4 * d, d)), (f"{prefix}.mlp.up.bias", (4 * d,)),
        (f"{prefix}.mlp.down.weight", (d, 4 * d)), (f"{prefix}.mlp.down.bias", (d,)),
    ]


def transformer_like_shapes(total_bytes: int, bytes_per_elem: int = 4) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor shapes of a GPT-like model of about ``total_bytes``: two embedding-size matrices,
    per layer four matrices (qkv, out, mlp up/down) and eight vectors (biases, norms)."""
    elems = total_bytes // bytes_per_elem
    d = 1024 if total_bytes >= 512 * MiB else 512 if total_bytes >= 64 * MiB else 128
    vocab = max(256, int(0.12 * elems / d))
    shapes: list[tuple[str, tuple[int, ...]]] = [("tok_emb", (vocab, d)), ("lm_head", (vocab, d))]
    used = 2 * vocab * d
    per_layer = 12 * d * d + 13 * d
    layer = 0
    while used + per_layer <= elems or layer == 0:
        shapes += layer_shapes(f"layers.{layer}", d)
        used += per_layer
        layer += 1
    rest = elems - used
    if rest >= d:  # top up with one more matrix so the total is close to what was asked
        shapes.append(("extra_w", (rest // d, d)))
    shapes += [("ln_f_w", (d,)), ("ln_f_b", (d,))]
    return shapes


def make_tensors(shapes: list[tuple[str, tuple[int, ...]]], seed: int = 0) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes:
        t = torch.empty(shape, dtype=torch.float32)
        t.uniform_(-0.02, 0.02, generator=g)
        out[name] = t
    return out


def as_module(tensors: dict[str, Any]) -> Any:
    """``tensors`` as the parameters of an ``nn.Module`` (sharing their memory), with the same
    names (dots make submodules): the shape of state a DDP job hands to a checkpointer."""
    import torch

    root = torch.nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


def nbytes(tensors: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def split_greedy(tensors: dict[str, Any], parts: int) -> list[list[str]]:
    """Largest first to the least-loaded part (how DCP's dedup spreads replicated writes)."""
    loads = [0] * parts
    out: list[list[str]] = [[] for _ in range(parts)]
    for name in sorted(tensors, key=lambda n: -tensors[n].numel()):
        i = loads.index(min(loads))
        out[i].append(name)
        loads[i] += tensors[name].numel() * tensors[name].element_size()
    return out


# ------------------------------------------------------------------------------------------
# file helpers
def drop_cache(path: str | os.PathLike) -> None:
    """Evict the (clean) pages of every file under ``path`` from the page cache."""
    p = Path(path)
    files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def steps_while_in_flight(ckpt: Any, step: Any, n: int) -> tuple[int, float]:
    """Run ``n`` training steps (the same number on every rank: DDP all-reduces in each one) and
    return how many ran while ``ckpt``'s async save was in flight, and the seconds they took."""
    done, t0 = 0, time.perf_counter()
    t_end = t0
    for _ in range(n):
        step()
        if ckpt.in_flight:
            done += 1
            t_end = time.perf_counter()
    return done, t_end - t0


def median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def machine_info() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = 0
    try:
        import psutil

        mem = psutil.virtual_memory().total
    except Exception:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem / GiB, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def run_folder(base: str | None, prefix: str) -> tuple[Path, bool]:
    """A new, empty folder for this run inside ``base`` (an existing ``--dir``; default
    ``benchmarks/.scratch``, created if missing), and whether ``base`` is that default: the run
    deletes only this folder (:func:`remove_scratch`), never what ``base`` held before."""
    parent = Path(base) if base else REPO / "benchmarks" / ".scratch"
    parent.mkdir(parents=True, exist_ok=True)
    exit_on_sigterm()
    return Path(tempfile.mkdtemp(prefix=f"{prefix}-{os.getpid()}-", dir=parent)), base is None


def exit_on_sigterm() -> None:
    """SIGTERM (``timeout``, ``kill``, a scheduler's cancel) as ``SystemExit``, so that the
    script's ``finally`` removes its run folder: killed outright, a run left gigabytes in
    ``--dir``. Only where SIGTERM has its default action (a handler of the caller's stays)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def remove_scratch(scratch: Path, own_parent: bool) -> None:
    """Delete a benchmark's scratch dir (and its parent if the benchmark created that too)."""
    shutil.rmtree(scratch, ignore_errors=True)
    if own_parent:
        try:
            scratch.parent.rmdir()
        except OSError:
            pass


def save_figure(fig: Any, png: Path) -> None:
    """Lay out, write and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def publish(result: dict[str, Any], table: str, json_path: str | None) -> dict[str, Any]:
    """Every benchmark's tail: print the table; write ``json_path`` and the table beside it (.md)."""
    print(table)
    if json_path:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Each file whole or not at all (a kill or a full disk mid-write left a truncated
        # committed result); the table first, so a .json is never newer than its table.
        _write_whole(path.with_suffix(".md"), table + "\n")
        _write_whole(path, json.dumps(result, indent=1))
    return result


def _write_whole(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it into place."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as open() makes it (mkstemp's 0600 kept others sharing the checkout out)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
