"""Storage: one small interface (``base.Storage``), two implementations.

``local`` is a POSIX filesystem (fsync, rename, symlinks refused), ``objectstore`` any fsspec
URL such as ``s3://`` (single-put commits, conditional writes). On top of them: ``ownership``
(which writer holds a step directory), ``retention`` (``keep_last``) and ``replica`` (the
background copy to a second root).
"""

# Importing the implementations registers them with ``Storage(root)`` (see storage.base).
from distckpt.storage import local, objectstore  # noqa: E402,F401
