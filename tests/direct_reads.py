"""Counting the tensors a load reads straight into their destinations (the reader's fast path),
for tests that promise it: a wrapper around ``CheckpointReader._read_direct`` that counts the
calls that served their tensor (it returns ``False``, having written nothing, when the record's
layout is not plain)."""

from __future__ import annotations

import threading

from distckpt.load import reader as _reader


class DirectReads:
    """Installed by :func:`count_direct_reads`; ``count`` is the number of stored tensors served."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()  # reader threads serve files side by side

    def wrap(self, real):
        def read_direct(reader, f, offset, length, head, targets, planner):
            served = real(reader, f, offset, length, head, targets, planner)
            if served:
                with self._lock:
                    self.count += len(targets)
            return served

        return read_direct


def count_direct_reads(monkeypatch=None) -> DirectReads:
    """Count direct reads from now on (undone by ``monkeypatch`` at the test's end if given;
    in a spawned rank process, which ends with the test, it is simply left installed)."""
    counter = DirectReads()
    wrapped = counter.wrap(_reader.CheckpointReader._read_direct)
    if monkeypatch is not None:
        monkeypatch.setattr(_reader.CheckpointReader, "_read_direct", wrapped)
    else:
        _reader.CheckpointReader._read_direct = wrapped
    return counter
