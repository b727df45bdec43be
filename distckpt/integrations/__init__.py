"""Integrations of distckpt with training frameworks.

Each integration imports its framework on import, so that ``import distckpt`` never does; install
the matching extra first:

* :mod:`distckpt.integrations.lightning` (``pip install 'distckpt[lightning]'``): a Lightning
  ``CheckpointIO`` plugin and the DDP strategy that calls it on every rank. Its helpers
  (:mod:`~distckpt.integrations.lightning_layout`, :mod:`~distckpt.integrations.lightning_pointers`)
  import no Lightning.
"""
