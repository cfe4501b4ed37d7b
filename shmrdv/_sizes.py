"""Byte sizes as people type them (``64k``, ``4m``, ``1g``) and as the command line prints them."""

from __future__ import annotations

__all__ = ["format_size", "parse_size"]

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
EXAMPLE = "e.g. 4096, 64k, 4m or 1g (binary units; 4mib and 4mb mean 4m too)"


def parse_size(text: str) -> int:
    """``"64"`` -> 64, ``"1k"`` -> 1024, ``"4m"``, ``"1.5g"``; ``ValueError`` with an example otherwise."""
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
    if not 1 <= value < float("inf"):  # also refuses nan
        raise ValueError(f"size {text!r} must be at least 1 byte; give {EXAMPLE}")
    return int(value)


def format_size(n: int) -> str:
    """``512 B``, ``1.5 KiB``, ``4.0 MiB``, ``2.0 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
