"""Element counts and row-major strides of tensor shapes, computed one way everywhere.

Shapes here come from checkpoint metadata (``torch.Size``, tuples or lists of ints), often for
tensors that are never allocated, so nothing here builds a tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def numel(shape: Iterable[int]) -> int:
    """Number of elements of a tensor of ``shape`` (1 for a scalar's empty shape)."""
    return math.prod(int(d) for d in shape)


def contiguous_strides(shape: Iterable[int]) -> tuple[int, ...]:
    """Strides of a contiguous (row-major) tensor of ``shape``, exactly as torch computes them
    (a zero-sized dimension counts as 1, so ``torch.empty(shape).stride()`` is the same)."""
    dims = [int(d) for d in shape]
    strides, acc = [], 1
    for d in reversed(dims):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))
