"""Integrations of distckpt with training frameworks.

Each submodule imports its framework on import, so that ``import distckpt`` never does; install
the matching extra first:

* :mod:`distckpt.integrations.lightning` (``pip install 'distckpt[lightning]'``): a Lightning
  ``CheckpointIO`` plugin and the DDP strategy that calls it on every rank.
"""
