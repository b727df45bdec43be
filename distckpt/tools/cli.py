"""The ``distckpt`` command: list, inspect, verify and convert checkpoints.

Examples::

    distckpt ls /ckpt/run1
    distckpt inspect /ckpt/run1 --step 1000 --json
    distckpt verify s3://bucket/run1/step_000001000 --storage-option client_kwargs='{"endpoint_url": "http://127.0.0.1:9000"}'
    distckpt convert /ckpt/run1 --to safetensors model.safetensors --dtype bf16
    distckpt convert /ckpt/run1 --to torch full.pt
    distckpt convert old.pt --to dcp /ckpt/imported
    distckpt convert /ckpt/run1 --to hf /models/run1-hf --key model --dtype bf16 --max-shard-size 5GB
    distckpt convert /models/llama-hf --to dcp /ckpt/from-hf

``CKPT`` is a step directory, a root (newest committed step, or ``--step N``) or a plain DCP
directory. Errors are one line on stderr (``distckpt: error: ...``); exit status 0 on success,
1 on failure (including ``verify`` finding bad files), 2 on wrong usage. ``--debug`` shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from typing import Any, NoReturn, TextIO

from fsspec.core import url_to_fs

from distckpt._version import __version__
from distckpt.errors import IntegrityError, StepDeletedError, UnsafeCheckpointError
from distckpt.integrity.manifest import DATA_FILE, parse_step_dir, tier_copy
from distckpt.integrity.shards import CheckpointSource
from distckpt.integrity.stepfiles import StepFiles
from distckpt.load.reader import CheckpointReader
from distckpt.state.decoding import decode_loaded
from distckpt.state.statecheck import compare_files
from distckpt.storage.base import Storage, local_path
from distckpt.tools import convert, importer
from distckpt.tools.outputs import is_url
from distckpt.tools.catalog import describe, list_steps, locate
from distckpt.tools.hf_convert import export_hf, import_hf

PROG = "distckpt"
# The start of the warning DCP gives on each single-process call (a regex, for warnings.filterwarnings).
_DCP_NO_PROCESS_GROUP = r"torch\.distributed is disabled, unavailable or uninitialized"


class _Usage(Exception):
    """A usage error (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line instead of usage + message
        raise _Usage(f"{message} (see '{self.prog} --help')")


def _is_dir(location: str, storage_options: dict) -> bool:
    """Whether ``location`` is a directory (a prefix on object stores)."""
    return _is(location, storage_options, "isdir")


def _is_file(location: str, storage_options: dict) -> bool:
    """Whether ``location`` is a file (an object)."""
    return _is(location, storage_options, "isfile")


def _is(location: str, storage_options: dict, test: str) -> bool:
    """``os.path.<test>`` of a local path, taken literally (``::`` in a name is no chain of URLs),
    else the filesystem's ``<test>`` (``isdir``/``isfile``: fsspec names them as ``os.path``)."""
    local = local_path(location)
    if local is not None:
        return bool(getattr(os.path, test)(local))
    fs, path = url_to_fs(location, **storage_options)
    return bool(getattr(fs, test)(path))


# -------------------------------------------------------------------------------------------------
# output helpers

def _human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _time(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _table(rows: list[list[str]], out: TextIO, right: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        print("  ".join(cells).rstrip(), file=out)


class _Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled and sys.stderr.isatty()
        self._last = 0.0
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < 0.1 and done < total:
            return
        self._last = now
        frac = done / total if total else 1.0
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r{self.label} [{bar:<30}] {frac:4.0%} {_human_bytes(done)} / {_human_bytes(total)}")
        sys.stderr.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _storage_options(pairs: list[str]) -> dict[str, object]:
    options: dict[str, object] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise _Usage(f"--storage-option expects KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def _check_options_apply(args: argparse.Namespace, opts: dict[str, object]) -> None:
    """Storage options configure fsspec filesystems for URLs; local paths take none. Given with
    local paths only, they would be ignored silently (a typo'd ``s3://`` that became a path)."""
    if not opts:
        return
    places = [getattr(args, name) for name in ("root", "ckpt", "src", "out") if isinstance(getattr(args, name, None), str)]
    if not any(is_url(p) for p in places):  # (file:// and local:// name local paths)
        raise _Usage(
            f"--storage-option applies to URLs only (s3://..., memory://...); {', '.join(places)} "
            f"{'is a local path' if len(places) == 1 else 'are local paths'}"
        )


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, KeyError) and text.startswith(("'", '"')):
        text = text[1:-1]
    return text


def _message(exc: BaseException) -> str:
    """The error for the user: its text (per-rank lines included, tracebacks left out) and its
    root cause (e.g. "No space left on device: PATH") when the text does not already say it."""
    text = _one_line(exc).split("\n(raised on rank", 1)[0].rstrip()
    cause, seen = exc, set()
    while (cause.__cause__ or cause.__context__) is not None and id(cause) not in seen:
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
    if cause is not exc:
        why = _one_line(cause).splitlines()[0] if _one_line(cause) else type(cause).__name__
        if why not in text:
            text = f"{text} (caused by {type(cause).__name__}: {why})"
    return text


# -------------------------------------------------------------------------------------------------
# commands
def _cmd_ls(args: argparse.Namespace, opts: dict[str, object]) -> int:
    storage = Storage(args.root, opts)
    rows = list_steps(storage)
    if args.json:
        json.dump({"root": storage.display(), "steps": rows}, sys.stdout, indent=1)
        print()
        return 0
    if not rows:
        if not args.quiet:
            print(f"no checkpoints under {storage.display()}", file=sys.stderr)
        return 0
    table = [["STEP", "STATUS", "SIZE", "WORLD", "CREATED"]]
    for r in rows:
        ws = r.get("world_size")
        table.append([str(r["step"]), r["status"], _human_bytes(r.get("bytes")), "-" if ws is None else str(ws), _time(r.get("created_unix"))])
    _table(table, sys.stdout, right={0, 2, 3})
    return 0


def _finite(value: Any) -> Any:
    """``value`` with non-finite floats as strings: a manifest edited by hand or by another tool
    can hold ``NaN`` (Python's json reads it), which strict JSON readers (``jq``) refuse, so
    ``--json`` output keeps to standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _cmd_inspect(args: argparse.Namespace, opts: dict[str, object]) -> int:
    found = locate(args.ckpt, opts, args.step)
    with found.kept("inspected"):
        info = describe(found)
    if args.json:
        json.dump(_finite(info), sys.stdout, indent=1, default=str, allow_nan=False)
        print()
        return 0
    out = sys.stdout
    m = info["manifest"]
    print(f"checkpoint  {info['location']}", file=out)
    if m is not None:
        print(f"step        {m['step']}  (world size {m['world_size']}, saved {_time(m['created_unix'])})", file=out)
        print(f"written by  torch {m['torch_version']}, distckpt {m['distckpt_version']}", file=out)
        kinds = ", ".join(f"{k} ({v.get('kind')}{', ' + v['parallel'] if v.get('parallel') else ''})" for k, v in sorted(m["entries"].items()))
        print(f"entries     {kinds}", file=out)
        print(f"checksums   {m['checksum_algorithm'] or 'none'}", file=out)
        if m.get("extra"):
            print(f"extra       {json.dumps(m['extra'], sort_keys=True)}", file=out)
    else:
        print("manifest    none (a plain DCP checkpoint)", file=out)
    if info["unverified"]:
        print(f"UNVERIFIED  {'; '.join(info['unverified'])}", file=out)
    print(file=out)
    table = [["KEY", "DTYPE", "SHAPE", "BYTES", "SHARDS"]]
    for r in info["entries"]:
        shape = "-" if r["shape"] is None else "[" + ", ".join(map(str, r["shape"])) + "]"
        table.append([r["key"], r["dtype"] or "value", shape, _human_bytes(r["bytes"]), str(r["shards"])])
    _table(table, out, right={3, 4})
    t = info["totals"]
    print(
        f"\n{t['tensors']} tensors ({t['parameters']:,} elements, {_human_bytes(t['tensor_bytes'])}), "
        f"{t['values']} values; {t['files']} files, {_human_bytes(t['file_bytes'])} on storage",
        file=out,
    )
    return 0


def _decoded_as_loaded(value: object, key: str) -> None:
    """Decode a value read from a checkpoint as a load does (distckpt's encoded form rebuilt), so
    that what a load would refuse as malformed fails verify. A value of a class of the training
    code is no error: only a process holding the class rebuilds it (``safe_types``), and this
    command never imports a class a checkpoint names."""
    try:
        decode_loaded(value, key)
    except UnsafeCheckpointError:
        pass


def _cmd_verify(args: argparse.Namespace, opts: dict[str, object]) -> int:
    found = locate(args.ckpt, opts, args.step)
    if found.manifest is None:
        raise ValueError(f"{found.display()} has no distckpt manifest: nothing to verify its files against")
    # A read failing because the step is deleted meanwhile (an object store's read of a file listed
    # a moment ago) says so, as do problems found for that reason (below).
    with found.kept("verified"):
        problems = found.problems()
        not_here = _not_on_this_node(found)
        problems = [p for p in problems if p not in {f"{found.display(n)}: missing" for n in not_here}]
        if not_here and args.state:
            problems.append(
                f"{found.display()}: --state needs every file; this node's tier copy lacks {len(not_here)} (on other nodes' tiers)"
            )
        if not problems:
            try:
                found.metadata()
            except Exception as exc:  # noqa: BLE001 - reported as a problem
                problems.append(f"{found.display('.metadata')}: unreadable ({_message(exc)})")
        checked_state = checked_values = None
        unfingerprinted: list[str] = []
        unproven: list[str] = []  # what --state could not check: unverified, not "OK"
        if args.state and not problems:
            # Recompute every tensor's fingerprint from the files, as the saving ranks did.
            if not found.manifest.fingerprints:
                problems.append(f"{found.display()}: --state: the manifest records no fingerprints (saved with fingerprint=False or an older distckpt)")
            else:
                source = CheckpointSource(found, CheckpointReader)
                bad, checked_state, lacking, unfingerprinted = compare_files(
                    source, found.manifest.fingerprints, found.manifest.fingerprint_version
                )
                problems += [f"{found.display()}: tensor {k!r}: stored values do not match the fingerprint recorded at save" for k in bad]
                if lacking:  # nothing proves these: never a silent pass (exit 1 unless --allow-unverified)
                    shown = ", ".join(repr(k) for k in lacking[:20]) + (f", ... (+{len(lacking) - 20} more)" if len(lacking) > 20 else "")
                    unproven.append(
                        f"--state: {len(lacking)} stored tensor(s) have no fingerprint in the manifest (replicas that "
                        f"drifted at save, or the manifest or .metadata was altered): {shown}"
                    )
                # Values carry no fingerprint: each is read as a load reads it, its stored bytes checked
                # against the manifest's value_digests (manifests written before those: unverified).
                checked_values = len(source.values) if found.manifest.value_digests is not None else 0
                if found.manifest.value_digests is None and source.values:
                    print(
                        f"WARNING {found.display()}: --state: the manifest predates value digests; its {len(source.values)} "
                        "non-tensor items (optimizer hyper-parameters, scheduler fields, ...) are read but not verified",
                        file=sys.stderr,
                    )
                for key in source.values:
                    try:
                        value, stored_as_json = source.read_value_and_form(key)
                        if not stored_as_json:  # (JSON text is a plain value already, as a load gives it)
                            _decoded_as_loaded(value, key)
                    except Exception as exc:  # noqa: BLE001 - reported as a problem
                        problems.append(f"{found.display()}: value {key!r}: unreadable ({_message(exc)})")
                try:
                    source.finish()  # what was read for the fingerprints is what the checksums cover
                except Exception as exc:  # noqa: BLE001 - reported as a problem
                    problems.append(_message(exc))
    if problems:
        why = found.changed_since("verified")
        if why:  # files missing because the step was deleted meanwhile: no damage to report
            raise StepDeletedError(why)
    files = found.manifest.files
    # Checksums that are not there verify nothing: say so instead of "OK".
    unverified = found.unverified + unproven
    if unverified and not args.allow_unverified:
        problems += [f"{found.display()}: UNVERIFIED: {u}" for u in unverified]
    if args.json:
        json.dump(
            {"checkpoint": found.display(), "ok": not problems, "verified": not unverified, "files": len(files),
             "bytes": found.manifest.total_bytes, "problems": problems, "unverified": unverified,
             "not_on_this_node": not_here},
            sys.stdout, indent=1,
        )  # fmt: skip
        print()
    elif problems:
        for line in problems:
            print(f"FAILED {line}", file=sys.stderr)
        print(f"{PROG}: error: {found.display()}: failed verification: {len(problems)} problem(s) ({len(files)} files checked)", file=sys.stderr)
    elif unverified:
        only = "; only sizes were checked" if found.unverified else ""
        print(f"WARNING {found.display()}: unverified ({'; '.join(unverified)}){only}", file=sys.stderr)
    elif not args.quiet:
        how = f"sizes and {found.manifest.checksum_algorithm} checksums"
        if checked_state is not None:
            how += f"; fingerprints of {checked_state} tensors"
            if unfingerprinted:  # (quantized: no save records a fingerprint of them)
                how += f" ({len(unfingerprinted)} not fingerprintable (quantized), checksums only: {', '.join(map(repr, unfingerprinted[:5]))})"
        if checked_values:
            how += f", digests of {checked_values} non-tensor items"
        if not_here:
            print(
                f"OK {found.display()}: {len(files) - len(not_here)} of {len(files)} files, a node's tier copy ({how}); "
                f"{len(not_here)} data file(s) are not on this node (a node keeps its own ranks' files and its peer "
                "node's: with three nodes or more the others are on other nodes' tiers)"
            )
        else:
            print(f"OK {found.display()}: {len(files)} files, {_human_bytes(found.manifest.total_bytes)} ({how})")
    return 1 if problems else 0


def _not_on_this_node(found: StepFiles) -> list[str]:
    """The data files a local tier's copy (``found``: a step folder carrying the tier's mark) does
    not hold: by design on other nodes' tiers, not damage (a node keeps only its own ranks' files
    and its peer node's). ``[]`` for any other step."""
    step = parse_step_dir(found.dirname) if found.dirname else None
    if step is None or found.files is None or not tier_copy(found.storage, step):
        return []
    present = set(found.storage.list_files(found.dirname))
    return sorted(n for n in found.files if n not in present and DATA_FILE.fullmatch(n))


def _is_checkpoint(src: str, opts: dict[str, object]) -> bool:
    """Whether ``src`` is a checkpoint (a root, a step or a DCP directory), even a damaged one:
    ``convert SRC --to dcp`` that found no safetensors files then says so."""
    try:
        locate(src, opts)
    except IntegrityError:
        # A damaged manifest of a step folder, or one beside DCP's .metadata: a checkpoint all
        # the same. A manifest.json of something else (a dataset's) is no checkpoint.
        try:
            return parse_step_dir(src.rstrip("/").rpartition("/")[2]) is not None or ".metadata" in Storage(src, opts).list_files()
        except Exception:  # noqa: BLE001 - unreadable: the import's own error stands
            return False
    except Exception:  # noqa: BLE001 - not a checkpoint either: the import's own error stands
        return False
    return True


def _cmd_convert(args: argparse.Namespace, opts: dict[str, object]) -> int:
    if args.model_only and args.all:
        raise _Usage("--model-only and --all exclude each other")
    if args.encoded_values and args.to != "torch":
        raise _Usage("--encoded-values applies to --to torch")
    if args.replace and args.to != "hf":
        raise _Usage("--replace applies to --to hf")
    if args.to == "dcp":
        if args.key or args.dtype or args.model_only or args.all or args.overwrite:
            # (an import never replaces a committed step: another step, or another root)
            raise _Usage("--key, --dtype, --model-only, --all and --overwrite apply to exports, not to --to dcp")
        if _is_dir(args.src, opts):
            # A directory (or prefix): a Hugging Face checkpoint (safetensors, single or sharded).
            try:
                summary = import_hf(args.src, args.out, step=args.step or 0, storage_options=opts)
            except FileNotFoundError:
                if not _is_checkpoint(args.src, opts):
                    raise
                summary = None
            if summary is None:  # (raised here: the error is not "caused by" no safetensors files)
                raise ValueError(
                    f"{args.src} is a checkpoint already: --to dcp imports a Hugging Face safetensors directory or a "
                    "torch.save file; to copy a checkpoint, copy its step folder (or export it with --to "
                    "torch/safetensors/hf)"
                )
        elif args.src.rstrip("/").endswith(".safetensors") and _is_file(args.src, opts):
            # (it reached the torch.save import, which called it "a damaged copy")
            folder = args.src.rstrip("/").rpartition("/")[0] or "."
            raise ValueError(
                f"{args.src} is a safetensors file: --to dcp imports the Hugging Face folder holding it "
                f"(distckpt convert {folder} --to dcp {args.out})"
            )
        else:
            summary = importer.import_torch_save(args.src, args.out, step=args.step, storage_options=opts)
    elif args.to == "hf":
        if args.model_only or args.all:
            raise _Usage("--to hf exports one model: pick it with --key NAME (default: the checkpoint's module)")
        found = locate(args.src, opts, args.step)
        bar = _Progress("hf ", not args.quiet)
        try:
            with found.kept("exported"):
                summary = export_hf(
                    found, args.out, key=args.key, dtype=convert.DTYPES[args.dtype] if args.dtype else None,
                    max_shard_size=args.max_shard_size, storage_options=opts, progress=bar, overwrite=args.overwrite,
                    replace=args.replace,
                )  # fmt: skip
            summary.setdefault("unverified", found.unverified)
        finally:
            bar.close()
    else:
        if args.to == "safetensors" and args.all and args.key:
            raise _Usage("--all and --key exclude each other")
        found = locate(args.src, opts, args.step)
        dtype = convert.DTYPES[args.dtype] if args.dtype else None
        bar = _Progress(f"{args.to} ", not args.quiet)
        try:
            with found.kept("exported"):
                if args.to == "safetensors":
                    summary = convert.export_safetensors(
                        found, args.out, model_only=not args.all, key=args.key, dtype=dtype, storage_options=opts, progress=bar,
                        overwrite=args.overwrite,
                    )
                else:
                    summary = convert.export_torch(
                        found, args.out, model_only=args.model_only, key=args.key, dtype=dtype, storage_options=opts,
                        progress=bar, encoded_values=args.encoded_values, overwrite=args.overwrite,
                    )
        finally:
            bar.close()
    unverified = summary.get("unverified") or []
    if unverified:  # exported as read: say so even with --quiet
        print(f"WARNING {args.src}: unverified ({'; '.join(unverified)}); exported as read", file=sys.stderr)
    if args.json:
        json.dump(summary, sys.stdout, indent=1)
        print()
    elif not args.quiet:
        what = f"{summary['tensors']} tensors, {_human_bytes(summary['bytes'])}"
        print(f"wrote {summary['output']} ({what})", file=sys.stderr)
        if summary.get("skipped"):
            print(f"skipped {len(summary['skipped'])}: {', '.join(summary['skipped'][:10])}", file=sys.stderr)
    return 0


# -------------------------------------------------------------------------------------------------
def _step(text: str) -> int:
    """``--step``: a non-negative int (a usage error otherwise, not "step_-0000001 does not exist")."""
    try:
        step = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid step {text!r}: an int >= 0") from None
    if step < 0:
        raise argparse.ArgumentTypeError(f"invalid step {text!r}: steps are ints >= 0")
    return step


def build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument("--storage-option", "-o", action="append", default=[], metavar="KEY=VALUE",
                        help="fsspec storage option for URLs (repeatable; VALUE parsed as JSON when it is JSON)")
    common.add_argument("--quiet", "-q", action="store_true", help="no progress bar or messages")
    common.add_argument("--debug", action="store_true", help="show tracebacks")

    parser = _Parser(prog=PROG, description="List, inspect, verify and convert distckpt checkpoints.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("ls", parents=[common], help="steps under a root: committed or incomplete, size, world size, time")
    p.add_argument("root", help="checkpoint root (path or URL)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_ls)

    p = sub.add_parser("inspect", parents=[common], help="every entry: key, dtype, shape, bytes, shards; totals; manifest")
    p.add_argument("ckpt", help="step directory, root (newest step) or plain DCP directory")
    p.add_argument("--step", type=_step, help="step under a root (default: newest committed)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("verify", parents=[common], help="check that every file is present and intact")
    p.add_argument("ckpt", help="step directory or root (newest step)")
    p.add_argument("--step", type=_step, help="step under a root (default: newest committed)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--state", action="store_true",
                   help="also recompute every tensor's fingerprint from the files and compare it with the manifest")
    p.add_argument("--allow-unverified", action="store_true",
                   help="exit 0 (with a warning) when the manifest records no checksums to verify against")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("convert", parents=[common], help="export to one torch/safetensors file, or import a torch.save file")
    p.add_argument("src", help="checkpoint (for --to torch/safetensors) or torch.save file (for --to dcp)")
    p.add_argument("--to", required=True, choices=("torch", "safetensors", "hf", "dcp"),
                   help="output format: one torch/safetensors file, a Hugging Face directory (sharded "
                        "safetensors + index), or a distckpt checkpoint (from a torch.save file or a "
                        "Hugging Face directory)")
    p.add_argument("out", help="output file (torch, safetensors), directory (hf) or checkpoint root (dcp)")
    p.add_argument("--max-shard-size", default="5GB", help="--to hf: largest safetensors file (default 5GB)")
    p.add_argument("--model-only", action="store_true", help="only the model's tensors, flat (default for safetensors)")
    p.add_argument("--all", action="store_true", help="every tensor under its full key (default for torch, with values)")
    p.add_argument("--key", metavar="PREFIX", help="only tensors under PREFIX (e.g. the name of one model), prefix removed")
    p.add_argument("--dtype", choices=sorted(("fp32", "bf16", "fp16")), help="cast floating-point tensors")
    p.add_argument("--encoded-values", action="store_true",
                   help="--to torch: write non-JSON values (NumPy scalars, Enums, paths...) in distckpt's encoded "
                        "form, as plain dcp.load sees them (default: decoded, in plain types, or skipped)")
    p.add_argument("--step", type=_step, help="step to export (default newest) / step to import as (default: the file's step/epoch, else 0)")
    p.add_argument("--replace", action="append", default=[], metavar="NAME",
                   help="--to hf: a Hugging Face weight file there that distckpt did not write and may replace (name or pattern; repeatable)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output file (torch, safetensors), or distckpt's previous export (hf: other files are kept)")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=_cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``distckpt`` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    args: argparse.Namespace | None = None
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:  # --help / --version
            return int(exc.code or 0)
        with warnings.catch_warnings():
            if not debug:
                # DCP warns on every call without a process group, which the CLI never has.
                # Only that notice is hidden: every other warning still reaches stderr.
                warnings.filterwarnings("ignore", message=_DCP_NO_PROCESS_GROUP, category=UserWarning)
            for name in ("root", "ckpt", "src", "out"):
                if isinstance(getattr(args, name, None), str) and not getattr(args, name).strip():
                    # (an empty path is the working directory to os and fsspec: not what was meant)
                    raise _Usage(f"{name} is empty: give a checkpoint path or URL")
            opts = _storage_options(args.storage_option)
            _check_options_apply(args, opts)
            return int(args.func(args, opts))
    except _Usage as exc:
        if debug:
            raise
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        if getattr(args, "json", False) if args is not None else "--json" in argv:
            _json_error(exc)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 1
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(exc, SystemExit) or debug:
            raise
        print(f"{PROG}: error: {_message(exc)}", file=sys.stderr)
        if getattr(args, "json", False) if args is not None else "--json" in argv:
            _json_error(exc)
        return 1


def _json_error(exc: BaseException) -> None:
    """``--json``: a failed command still prints one JSON object (a script parsing the output
    gets ``ok: false`` and the reason, not an empty stdout); the message also went to stderr."""
    message = str(exc) if isinstance(exc, _Usage) else _message(exc)
    # A path that is not UTF-8 (surrogate escapes) as its escape text: strict JSON parsers refuse lone surrogates.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    try:
        print(json.dumps({"ok": False, "error": message, "type": type(exc).__name__.lstrip("_")}, indent=1), file=sys.stdout)
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - stdout closed, full or gone: stderr already said it
        pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
