"""Plots are optional: matplotlib comes with the `bench` extra (`pip install 'zocheck-ray[bench]'`).

Benchmarks print tables and write JSON without it; a command asked for a figure says so before it starts.
"""

from __future__ import annotations

INSTALL_HINT = "pip install 'zocheck-ray[bench]' (in a checkout: pip install -e '.[bench]')"
"""How to get the plots."""


class PlotsUnavailableError(RuntimeError):
    """A figure was asked for where matplotlib is not installed; the message says how to get it."""


def missing_reason() -> str | None:
    """None where matplotlib imports, else why not, with the way to install it."""
    try:
        import matplotlib  # noqa: F401  (the package itself: submodules in sys.modules prove nothing)
    except ImportError as error:
        return f"matplotlib is not installed ({error}); plots need it: {INSTALL_HINT}"
    return None


def require_matplotlib(what: str) -> None:
    """Raise `PlotsUnavailableError` naming `what` (e.g. "--plot waste.png") unless matplotlib imports."""
    reason = missing_reason()
    if reason is not None:
        raise PlotsUnavailableError(f"{what}: {reason}")


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    require_matplotlib("a figure")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
