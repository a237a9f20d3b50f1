"""How numbers are shown to people: bytes in binary units."""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: float) -> str:
    """n bytes in the largest binary unit that keeps it >= 1, e.g. '512 B', '3.2 MiB', '11.50 GiB'."""
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{int(value)} B"
    return f"{value:.2f} {_UNITS[unit]}" if unit >= 3 else f"{value:.1f} {_UNITS[unit]}"


def format_seconds(s: float) -> str:
    """s seconds in a unit that keeps 3 significant figures readable: '850 us', '12.5 ms', '3.20 s'."""
    if s == 0:
        return "0"
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1.0:
        return f"{s * 1e3:.3g} ms"
    return f"{s:.3g} s"
