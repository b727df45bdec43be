"""Tools on top of the library: the ``distckpt`` command (``cli``), listing and describing
checkpoints (``catalog``), export (``convert``) and import (``importer``), and the Hugging Face
workflow (``hf``, ``safetensors_io``).
"""
