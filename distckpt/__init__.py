"""distckpt: distributed, asynchronous, reshardable checkpoints for PyTorch, built on DCP.

Public API (every name below is re-exported here)::

    ckpt = distckpt.Checkpointer(root, keep_last=None, storage_options=None)
    ckpt.save(step, state, blocking=True)     # collective
    step = ckpt.load(state, step=None, strict=True)  # collective
    ckpt.steps(); ckpt.latest_step()          # any rank
    ckpt.wait(); ckpt.close()                 # collective
    distckpt.load_pretrained(model, hf_dir)   # collective: Hugging Face weights, any world size
    distckpt.save_pretrained(model, out_dir)  # collective: publish Hugging Face weights
"""

from ._version import __version__
from ._loading import LoadReport
from .checkpointer import Checkpointer, SaveStats
from .manifest import read_manifest
from .data import GlobalBatchSampler
from .errors import (
    CheckpointError,
    IntegrityError,
    StateMismatchError,
    StepExistsError,
    UnsafeCheckpointError,
)
from .manifest import Manifest
from .scope import Global, PerRank
from .hf import load_pretrained, save_pretrained
from .statecheck import ReplicaDriftError, StateDivergedError
from .storage import Storage

__all__ = [
    "__version__",
    "Checkpointer",
    "CheckpointError",
    "Global",
    "GlobalBatchSampler",
    "IntegrityError",
    "LoadReport",
    "Manifest",
    "PerRank",
    "ReplicaDriftError",
    "SaveStats",
    "StateDivergedError",
    "StateMismatchError",
    "StepExistsError",
    "Storage",
    "UnsafeCheckpointError",
    "load_pretrained",
    "read_manifest",
    "save_pretrained",
]
