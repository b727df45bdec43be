"""Manifest and integrity: what makes a directory a committed, verifiable checkpoint.

``manifest`` is the commit record bound to its step directory, ``checksums`` the per-file
checksum algorithms, ``stepfiles`` the one verified read path (every file a load, verify,
inspect or convert opens), ``metadata_check`` the validation of DCP's ``.metadata``,
``safe_pickle`` the allow-list unpickler, ``torchfile`` the layout of torch's zip records.
"""
