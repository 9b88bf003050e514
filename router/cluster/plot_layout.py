"""The layout of kvroute's PNG reports: panels side by side, one legend below them all.

A legend inside a panel sits on its data sooner or later (a bar grows under it); one
figure legend outside every panel never does. Every line and bar series carries a label,
so the legend names all of them; a label used in several panels (a policy's colour) is
listed once. matplotlib is optional (the ``plot`` extra) and imported only here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["add_legend", "new_figure", "save_figure"]


def new_figure(num_panels: int, title: str) -> tuple[Any, list[Any]]:
    """A figure of ``num_panels`` panels in a row, its layout leaving room for a legend.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'kvroute[plot]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(1, num_panels, figsize=(5 * num_panels, 4.8), layout="constrained")
    fig.suptitle(title, fontsize=9)
    return fig, list(axes)


def add_legend(fig: Any) -> Any:
    """Add the figure legend below the panels: every labelled artist, each label once.

    Returns:
        The legend, or ``None`` when nothing is labelled.
    """
    labelled: dict[str, Any] = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            labelled.setdefault(label, handle)
    if not labelled:
        return None
    return fig.legend(
        list(labelled.values()),
        list(labelled),
        loc="outside lower center",
        ncols=min(len(labelled), 6),
        frameon=False,
        fontsize="small",
    )


def save_figure(fig: Any, path: str | Path, dpi: int = 100) -> None:
    """Write the figure as a PNG and free it."""
    from matplotlib import pyplot as plt

    fig.savefig(path, dpi=dpi)
    plt.close(fig)
