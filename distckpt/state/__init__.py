"""The state model: what a training state is made of and how each part is saved and loaded.

``entries`` turns a user's mapping into entries (modules, optimizers, ZeRO partitions in
``zero``, stateful objects, plain values in ``values``), ``scope`` says whether an entry is
global or per rank, ``rng`` and ``data`` cover RNG states and data position, and
``fingerprint`` / ``statecheck`` prove a loaded state equals the saved one. ``shape`` is the
one numel/strides helper.
"""
