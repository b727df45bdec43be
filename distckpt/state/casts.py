"""Which dtype casts keep every value: a load into a tensor of another dtype (a bf16 checkpoint
into an fp32 model) is proven by casting the loaded values back to the saved dtype and comparing
fingerprints, which holds only where the cast lost nothing."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def exact_cast(saved: torch.dtype, loaded: torch.dtype) -> bool:
    """Whether every value of dtype ``saved`` is exactly a value of dtype ``loaded`` and casts
    back to the same bits (NaN payloads aside): ``bfloat16 -> float32`` yes, ``float32 ->
    bfloat16`` or ``int64 -> float64`` no. Floating-point types of one or two bytes are tried on
    every bit pattern; wider ones and integers by their ranges."""
    if saved == loaded:
        return True
    if loaded.is_complex:
        # Complex values are pairs of the component type: exact where the saved values (or
        # both parts of them) are exact in it (complex64 into complex128, float32 into complex64).
        return exact_cast(saved.to_real() if saved.is_complex else saved, loaded.to_real())
    if saved.is_complex or loaded == torch.bool:
        return False
    if saved == torch.bool:
        return True  # 0 and 1 are in every type, and cast back to False and True
    if saved.is_floating_point:
        if not loaded.is_floating_point:
            return False
        size = torch.empty((), dtype=saved).element_size()
        if size > 2:
            return saved == torch.float32 and loaded == torch.float64
        bits = torch.arange(1 << (8 * size), dtype=torch.int32).to(torch.uint8 if size == 1 else torch.int16).view(saved)
        try:
            back = bits.to(loaded).to(saved)
        except (RuntimeError, TypeError):
            return False  # a cast torch does not have
        same = back.view(bits.dtype) == bits.view(bits.dtype)
        return bool((same | torch.isnan(bits.float())).all())
    # integer saved
    info = torch.iinfo(saved)
    if loaded.is_floating_point:
        digits = torch.finfo(loaded).eps  # 2**-mantissa bits
        exact = int(round(1 / digits)) * 2  # every integer up to 2**(mantissa + 1) is exact
        return max(abs(info.min), info.max) <= exact
    other = torch.iinfo(loaded)
    return other.min <= info.min and info.max <= other.max


def cast_back(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` cast to ``dtype``; from a complex type into a real one, their real parts (torch's
    cast warns that it discards the imaginary ones: callers check first that those are zero)."""
    if values.is_complex() and not dtype.is_complex:
        values = values.real
    return values.to(dtype)
