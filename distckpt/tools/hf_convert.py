"""Offline conversion between Hugging Face directories and distckpt checkpoints (the CLI's
``distckpt convert HF_DIR --to dcp OUT_ROOT`` and ``distckpt convert CKPT --to hf OUT_DIR``).

* :func:`import_hf`: a safetensors directory (single file, or shards + index) as entry
  ``model`` of a distckpt checkpoint that any world size loads.
* :func:`export_hf`: a checkpoint's model as a Hugging Face directory, streamed from the
  checkpoint's data files and published by the protocol of
  :func:`~distckpt.tools.hf.save_pretrained` (:class:`~distckpt.tools.hf_publish.Publish`).

Not collective: call from one process.
"""

from __future__ import annotations

import mmap
import tempfile
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from distckpt.checkpointer import Checkpointer
from distckpt.integrity.stepfiles import StepFiles
from distckpt.storage.base import Storage
from distckpt.tools.convert import open_source, warn_beyond_range, write_tensor
from distckpt.tools.hf_publish import (
    DigestingFile,
    Layout,
    PlannedTensor,
    Publish,
    parse_size,
    plan_files,
    plan_tensor,
    publish_folder,
    replace_patterns,
)
from distckpt.tools.outputs import check_output
from distckpt.tools.safetensors_io import SafetensorsIndex
from distckpt.tools.selection import select_tensors


def import_hf(
    src: str,
    out_root: str,
    *,
    step: int = 0,
    storage_options: Mapping[str, object] | None = None,
) -> dict[str, Any]:
    """Import a Hugging Face safetensors directory as entry ``model`` of a distckpt checkpoint.

    Like the ``torch.save`` import (:func:`distckpt.tools.importer.import_torch_save`): afterwards
    ``Checkpointer(out_root).load({"model": model})`` works at any world size. Local files are
    memory-mapped (copy-on-write, never modified) so that resident memory stays bounded by what
    DCP writes at a time; a URL is downloaded to a temporary directory first. Not collective.

    Returns:
        A summary: output, step, tensors, bytes.

    Raises:
        ValueError: ``out_root`` is ``src`` or inside a checkpoint step
            (:func:`distckpt.tools.outputs.check_output`).
    """
    opts = dict(storage_options or {})
    check_output(out_root, opts, inputs=(src,))  # never into a checkpoint step, never over src
    with tempfile.TemporaryDirectory(prefix="distckpt-hf-import-") as tmp:
        source = Storage(src, opts)
        index = SafetensorsIndex(source)
        # The files themselves (local), or a download of them; re-validated against those bytes.
        # (with the index: without it the shards are refused as an unfinished publish)
        names = sorted({s.file for s in index.spans.values()}) + ([index.index_file] if index.index_file else [])
        local = source.local_dir(names, tmp)
        index = SafetensorsIndex(Storage(local))
        maps: dict[str, mmap.mmap] = {}
        tensors: dict[str, torch.Tensor] = {}
        try:
            for key, span in index.spans.items():
                if span.file not in maps:
                    # Opened as the index read it (never through a link, but a cache snapshot's
                    # into its blobs) and checked to be the file whose header it read: a plain
                    # open() followed a link swapped in since, and its bytes became weights.
                    with index.open(span.file) as f:
                        index.files[span.file].check(f, Storage(local).display(span.file))
                        maps[span.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                raw = torch.frombuffer(maps[span.file], dtype=torch.uint8)
                block = raw[span.start : span.start + span.nbytes]
                itemsize = torch.empty((), dtype=span.dtype).element_size()
                if span.start % itemsize:  # unaligned for its dtype: copy this one tensor
                    block = block.clone()
                tensors[key] = block.view(span.dtype).reshape(span.shape)
            ckpt = Checkpointer(out_root, storage_options=opts, save_rng=False)
            try:
                ckpt.save(step, {"model": tensors}, metadata={"imported_from": source.display()})
            finally:
                ckpt.close()
        finally:
            tensors.clear()
            for m in maps.values():
                try:
                    m.close()
                except BufferError:  # a view is still alive somewhere: the GC closes it
                    pass
    return {
        "output": Storage(out_root, opts).display(),
        "step": step,
        "tensors": len(index.spans),
        "bytes": sum(s.nbytes for s in index.spans.values()),
    }


def export_hf(
    found: StepFiles,
    out: str,
    *,
    key: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    storage_options: Mapping[str, object] | None = None,
    progress: Callable[[int, int], None] | None = None,
    overwrite: bool = False,
    replace: str | Iterable[str] = (),
) -> dict[str, Any]:
    """Write a distckpt checkpoint's model as a Hugging Face directory (sharded safetensors + index).

    Streams tensor by tensor from the checkpoint's data files (memory: about one block), like the
    other exports. The model is the checkpoint's single module entry, or the entry/prefix
    ``key`` (removed from the names, as for ``--to safetensors``). Each data file of the
    checkpoint is read once, in on-disk order, and checked against the manifest before the
    output is committed, by the protocol of :func:`~distckpt.tools.hf.save_pretrained`
    (:class:`~distckpt.tools.hf_publish.Publish`): a new directory renamed into place, or the
    files moved into an existing one, the index last; a failed export removes what it wrote.
    Not collective.

    Args:
        found: a located checkpoint (:func:`distckpt.tools.catalog.locate`).
        out: the directory to publish into: it must not hold a checkpoint (distckpt's or other
            Hugging Face weights) yet; other files there are kept. Never inside a checkpoint step.
        key, dtype, max_shard_size: what to export, cast (floating-point dtypes) and how to split it.
        storage_options: fsspec options for ``out``.
        progress: ``progress(bytes done, bytes total)``.
        overwrite: replace distckpt's own previous publish at ``out`` (as for
            :func:`~distckpt.tools.hf.save_pretrained`); other files are never replaced.
        replace: Hugging Face weight files at ``out`` that distckpt did not write but this
            export may replace or remove (names or patterns, as for ``save_pretrained``).

    Returns:
        A summary: output, files, tensors, bytes.
    """
    opts = dict(storage_options or {})
    patterns = replace_patterns(replace)  # (a bad pattern before anything is read)
    source = open_source(found, out, opts)
    picked = select_tensors(found, source, model_only=key is None, key=key)
    # Tensors in the order their bytes lie in the checkpoint's data files (as the other exports
    # read them): writing the shard files one after another then reads each data file once,
    # front to back, hashed as it goes. Shards are cut from this order; the index maps names.
    planned: list[PlannedTensor] = []
    for name, k in sorted(picked, key=lambda p: source.position(p[1])):
        info = source.tensors[k]
        planned.append(plan_tensor(name, k, info.shape, info.dtype, dtype, f"export of checkpoint key {k!r}"))
    by_name = dict(picked)
    layout = Layout(plan_files(planned, parse_size(max_shard_size)))
    storage = publish_folder(out, opts)
    publish = Publish.begin(storage, layout, overwrite=overwrite, patterns=patterns, out=out)
    target = publish.target(storage)
    done = 0
    digests: dict[str, str] = {}
    try:
        for i, entries in enumerate(layout.files):
            with target.open(layout.names[i], "wb") as opened:
                f = DigestingFile(opened)
                f.write(layout.headers[i])
                for t in entries:
                    write_tensor(f, source, by_name[t.key], t.dtype, t.nbytes)
                    done += t.nbytes
                    if progress:
                        progress(done, layout.total)
                if i == len(layout.files) - 1:
                    # Every data file read is checked whole before the last shard closes (an
                    # object store publishes a file when it closes).
                    source.finish()
                target.sync_file(opened)
                digests[layout.names[i]] = f.hexdigest()
        publish.commit(storage, layout, digests)
    except BaseException:
        publish.abandon(storage)  # nothing unverified or partial stays behind
        raise
    beyond = list(source.beyond_range)  # (every cast read is a tensor written)
    warn_beyond_range(f"export of {found.display()} to {storage.display()}", beyond, dtype)
    return {
        "output": storage.display(), "format": "hf", "files": layout.names, "tensors": len(planned), "bytes": layout.total,
        "beyond_range": beyond,
    }  # fmt: skip
