"""Which dtype casts keep every value: a load into a tensor of another dtype (a bf16 checkpoint
into an fp32 model) is proven by casting the loaded values back to the saved dtype and comparing
fingerprints, which holds only where the cast lost nothing; and which values an export's cast
into a narrower type pushes beyond that type's range (:func:`beyond_range`)."""

from __future__ import annotations

import functools
import math

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


def beyond_range(values: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether casting floating-point ``values`` into the narrower-ranged ``dtype`` loses some
    to its range: they round beyond its largest finite value (into ``inf``; a float8 type
    without infinities saturates to its largest value, or gives NaN), or are infinities it
    cannot hold. Decided on the values before the cast: a saturated ``float8_e4m3fn`` value
    cannot be told from a true 448 afterwards."""
    if not (values.dtype.is_floating_point and dtype.is_floating_point) or not values.numel():
        return False
    info = torch.finfo(dtype)
    holds_inf = bool(torch.isinf(torch.tensor(math.inf).to(dtype).float()))
    wider = torch.finfo(values.dtype).max <= info.max
    if wider and holds_inf:
        return False
    wide = values.float() if values.element_size() == 1 else values  # float8 has no abs kernel
    if wider:  # only infinities are lost (float8_e5m2 into float8_e5m2fnuz: NaN)
        return bool(torch.isinf(wide).any())
    # Round to nearest: from half a unit in the last place above the largest value on, a value
    # rounds beyond it.
    limit = info.max + 2.0 ** math.floor(math.log2(info.max)) * info.eps / 2
    big = wide.abs() >= limit
    if holds_inf:
        big &= torch.isfinite(wide)
    return bool(big.any())
