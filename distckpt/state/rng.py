"""Per-rank random number generator state: Python, torch CPU, CUDA (when present), NumPy (if installed).

Saved under ``_rng.rank_<r>`` by every rank. On load:

* same world size: rank ``r`` gets back exactly the states rank ``r`` saved;
* different world size: rank-to-rank correspondence is gone, so every rank ``r`` reseeds all its
  generators with ``seed(r) = crc32(rank 0's saved torch CPU state) ^ (step * 1_000_003 + r)``
  (see :func:`derived_seed`). That is deterministic (two resumes at the same new world size draw
  the same numbers) and gives each rank its own stream.
"""

from __future__ import annotations

import json
import random
import types
import zlib
from collections.abc import Mapping

import torch

NAMESPACE = "_rng"


def _numpy() -> types.ModuleType | None:
    try:
        import numpy

        return numpy
    except ImportError:  # pragma: no cover - numpy is a dependency, but stay usable without
        return None


def _cuda_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def capture() -> dict[str, torch.Tensor | str]:
    """This rank's generator states as a DCP-storable dict (tensors and JSON strings)."""
    state: dict[str, torch.Tensor | str] = {
        "python": json.dumps(_py_state_to_json(random.getstate())),
        "torch": torch.get_rng_state(),
    }
    if _cuda_available():
        state["cuda"] = torch.cuda.get_rng_state()
    np = _numpy()
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = json.dumps(
            {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)}
        )
        state["numpy_keys"] = torch.from_numpy(keys.astype("int64"))
    return state


def restore(state: Mapping[str, torch.Tensor | str]) -> None:
    """Set this rank's generators from :func:`capture`'s output."""
    if "python" in state:
        random.setstate(_py_state_from_json(json.loads(state["python"])))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    np = _numpy()
    if np is not None and "numpy" in state and "numpy_keys" in state:
        meta = json.loads(state["numpy"])
        keys = state["numpy_keys"].numpy().astype("uint32")
        np.random.set_state((meta["kind"], keys, meta["pos"], meta["has_gauss"], meta["gauss"]))


def derived_seed(rank0_torch_state: torch.Tensor, step: int, rank: int) -> int:
    """The seed rank ``rank`` uses after a world-size change (see the module docstring)."""
    base = zlib.crc32(rank0_torch_state.numpy().tobytes())
    return (base ^ (step * 1_000_003 + rank)) % (2**63 - 1)


def reseed(seed: int) -> None:
    """Seed every generator this module knows from one integer."""
    random.seed(seed)
    torch.manual_seed(seed)
    np = _numpy()
    if np is not None:
        np.random.seed(seed % (2**32))


def _py_state_to_json(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _py_state_from_json(raw: list) -> tuple:
    version, internal, gauss = raw
    return (version, tuple(internal), gauss)
