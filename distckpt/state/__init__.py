"""The state model: what a training state is made of and how each part is saved and loaded.

``build`` turns a user's mapping into entries (``entries``: modules, optimizers, stateful objects,
tensors, plain values; ``zero``: ZeRO partitions), ``scope`` says whether an entry is global or
per rank, ``rng`` and ``data`` cover RNG states and data position. Non-tensor values: ``values``
(plain top-level values and the digests of stored items), ``encoded`` / ``decoding`` (the form a
weights-only load can read, and back), ``safetypes`` (the classes a user registers) and
``containers`` (DCP's flattening rule and the containers a load gives back). Tensors:
``fingerprint`` (on ``fpkernels``) and ``statecheck`` prove a loaded state equals the saved one,
``placements`` says which ranks hold the same block of a DTensor. ``shape`` is the one
numel/strides helper.
"""
