"""Small helpers every kernel module shares."""

from __future__ import annotations


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``): Triton tiles and
    ``tl.arange`` extents must be powers of two."""
    return 1 << max(0, (int(n) - 1).bit_length())


def prev_pow2(n: int) -> int:
    """The largest power of two ``<= max(n, 1)``."""
    return 1 << (max(1, int(n)).bit_length() - 1)
