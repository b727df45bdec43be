"""The CUDA tier writes GBs per test (five saves of 2.6 GB state each): every test's ``tmp_path``
is removed when it ends, so that the tier fits a GPU machine's disk (pytest otherwise keeps
each test's folder until the session ends, ~70 GB for this tier)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _remove_tmp_path_after(request: pytest.FixtureRequest) -> Iterator[None]:
    # Taken before the test: at teardown pytest no longer hands out a fixture's value.
    path = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
