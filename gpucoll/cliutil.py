"""What the command-line tools (``bench``, ``topo``, ``run``) share: the usage-error type, byte
counts as people type them, and the optional matplotlib import."""

from __future__ import annotations

from . import config

__all__ = ["UsageError", "parse_size", "require_matplotlib"]


class UsageError(ValueError):
    """A bad command-line argument (the CLI prints it with the usage and exits 2)."""


def parse_size(text: str, what: str = "size") -> int:
    """Bytes from ``8``, ``1K``, ``64M``, ``1G``, ``256KiB``, ``4MB`` (binary multiples, as
    nccl-tests; the grammar of byte-count settings in ``gpucoll.config``).

    Raises:
        UsageError: not a byte count.
    """
    try:
        value = config.parse_bytes(str(text))
    except ValueError:
        raise UsageError(f"bad {what} {text!r}: expected a byte count such as 8, 1K, 64M or "
                         f"1G") from None
    if value < 0:
        raise UsageError(f"bad {what} {text!r}: must not be negative")
    return value


def require_matplotlib(flag: str = "--plot"):
    """``matplotlib.pyplot`` with a headless backend, or UsageError saying what to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError(f"{flag} needs matplotlib: pip install 'gpucoll[plot]' "
                         "(or pip install matplotlib)") from None
    return plt
