"""Tools on top of the library: the ``distckpt`` command (``cli``), listing and describing
checkpoints (``catalog``), export to one file (``convert``, choosing what with ``selection`` and
writing where ``outputs`` allows), import of a ``torch.save`` file (``importer``), and the Hugging
Face workflow: weights in a distributed job (``hf``), the publish protocol (``hf_publish``),
offline conversion both ways (``hf_convert``) and the safetensors format (``safetensors_io``).
The checkpoint reader they share is :mod:`distckpt.integrity.shards`.
"""
