"""Byte sizes as people type them (``64k``, ``4m``, ``1g``) and as the command line prints them."""

from __future__ import annotations

__all__ = ["format_size", "parse_size"]

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
EXAMPLE = "e.g. 4096, 64k, 4m or 1g (binary units; 4mib and 4mb mean 4m too)"


def parse_size(text: str, minimum: int = 1) -> int:
    """``"64"`` -> 64, ``"1k"`` -> 1024, ``"4m"``, ``"1.5g"``, at least ``minimum`` bytes;
    ``ValueError`` with an example otherwise."""
    s = text.strip().lower()
    for tail in ("ib", "b"):
        if s.endswith(tail) and len(s) > len(tail):
            s = s[: -len(tail)]
            break
    unit = s[-1] if s and s[-1] in "kmg" else ""
    number = s[: len(s) - len(unit)]
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"not a size: {text!r}; give {EXAMPLE}") from None
    if not minimum <= value < float("inf"):  # also refuses nan
        least = "1 byte" if minimum == 1 else f"{minimum} bytes"
        raise ValueError(f"size {text!r} must be at least {least}; give {EXAMPLE}")
    return int(value)


def format_size(n: int) -> str:
    """``512 B``, ``4 KiB``, ``1.5 KiB``, ``16 MiB``, ``2.3 GiB``: a whole number of a unit stays whole."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            break
        value /= 1024
    return f"{value:.0f} {unit}" if value.is_integer() else f"{value:.1f} {unit}"
