"""Text formatting shared by the sub-commands' tables."""

from __future__ import annotations


def human_bytes(nbytes: float) -> str:
    """Bytes in binary units: ``512 B``, ``1.5 KiB``, ``3.0 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"
