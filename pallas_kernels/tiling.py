"""Tile-size arithmetic shared by the Pallas kernels (Triton wants power-of-two block shapes)."""

NUM_SMS = 132  # H100/H200: the kernels size their grids and split-K against it


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def largest_pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two that divides n and is <= cap."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d
