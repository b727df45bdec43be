"""distckpt: distributed, asynchronous, reshardable checkpoints for PyTorch, built on DCP.

Public API (every name below is re-exported here)::

    ckpt = distckpt.Checkpointer(root, keep_last=None, storage_options=None)
    ckpt.save(step, state, blocking=True)     # collective
    step = ckpt.load(state, step=None, strict=True)  # collective
    ckpt.steps(); ckpt.latest_step()          # any rank
    ckpt.wait(); ckpt.close()                 # collective
    ckpt.replica.wait(); ckpt.replica.status() # any rank: uploads to replicate_to (coordinator's)
    distckpt.load_pretrained(model, hf_dir)   # collective: Hugging Face weights, any world size
    distckpt.save_pretrained(model, out_dir)  # collective: publish Hugging Face weights
"""

from distckpt._version import __version__
from distckpt.load.phases import LoadReport
from distckpt.checkpointer import Checkpointer, SaveStats
from distckpt.integrity.manifest import read_manifest
from distckpt.state.data import GlobalBatchSampler
from distckpt.errors import (
    CheckpointError,
    IntegrityError,
    Interrupted,
    StagingMismatchError,
    StateMismatchError,
    StepDeletedError,
    StepExistsError,
    UnsafeCheckpointError,
)
from distckpt.integrity.manifest import Manifest
from distckpt.state.scope import Global, PerRank
from distckpt.tools.hf import load_pretrained, save_pretrained
from distckpt.state.statecheck import ReplicaDriftError, StateDivergedError
from distckpt.storage.base import Storage
from distckpt.storage.replica import ReplicaStatus, ReplicationError, Replicator

__all__ = [
    "__version__",
    "Checkpointer",
    "CheckpointError",
    "Global",
    "GlobalBatchSampler",
    "IntegrityError",
    "Interrupted",
    "LoadReport",
    "Manifest",
    "PerRank",
    "ReplicaDriftError",
    "ReplicaStatus",
    "ReplicationError",
    "Replicator",
    "SaveStats",
    "StagingMismatchError",
    "StateDivergedError",
    "StateMismatchError",
    "StepDeletedError",
    "StepExistsError",
    "Storage",
    "UnsafeCheckpointError",
    "load_pretrained",
    "read_manifest",
    "save_pretrained",
]
