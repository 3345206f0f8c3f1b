"""One plotting module for every study: figures drawn to files only, the same look in every chart.

:func:`figure` opens a grid of panels (or returns None, with a note, where matplotlib is missing: charts are
optional, the results files are written anyway); :func:`spreads` draws a figure per variant against a category
axis (the links) as the median with its [min, max] as an error bar; :func:`curves` draws lines (loss against
steps, time or bytes); :func:`references` draws horizontal reference lines (a corpus's entropies, a bar);
:func:`rectangle` a cell;
:func:`save` lays the figure out, writes it and frees it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .repeats import Spread

DPI = 110


def figure(rows: int = 1, cols: int = 1, size: tuple[float, float] = (6.0, 4.5)) -> tuple[Any, Any] | None:
    """A figure of ``rows`` x ``cols`` panels of ``size`` inches each and its axes (always a 2-d array), drawn
    with matplotlib's Agg backend (to files only); None, with a note on stderr, where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is missing (pip install matplotlib); no chart written", file=sys.stderr)
        return None
    return plt.subplots(rows, cols, figsize=(size[0] * cols, size[1] * rows), squeeze=False)


def spreads(
    ax: Any,
    categories: Sequence[str],
    series: Mapping[str, Mapping[str, Spread]],
    styles: Mapping[str, Mapping[str, Any]] | None = None,
    log: bool = True,
) -> None:
    """On ``ax``, each of ``series`` (label -> category -> spread) as a line through its medians at the
    ``categories`` it has, each point with its [min, max] as an error bar; ``styles`` adds matplotlib keywords per
    label; a log scale unless ``log`` is False."""
    for label, points in series.items():
        xs = [i for i, c in enumerate(categories) if c in points]
        if not xs:
            continue
        mids = [points[categories[i]].median for i in xs]
        below = [m - points[categories[i]].low for i, m in zip(xs, mids)]
        above = [points[categories[i]].high - m for i, m in zip(xs, mids)]
        style = {"marker": "o", "capsize": 3, **(styles or {}).get(label, {})}
        ax.errorbar(xs, mids, yerr=[below, above], label=label, **style)
    ax.set_xticks(range(len(categories)), categories)
    if log:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)


def curves(
    ax: Any,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    styles: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """On ``ax``, each of ``series`` (label -> (xs, ys)) as a line; ``styles`` adds matplotlib keywords per
    label."""
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, label=label, **(styles or {}).get(label, {}))
    ax.grid(alpha=0.3)


def references(ax: Any, lines: Mapping[str, float]) -> None:
    """On ``ax``, a dotted horizontal line at each of ``lines``' values, labelled with its name."""
    for i, (label, y) in enumerate(lines.items()):
        ax.axhline(y, linestyle=":", color=f"C{7 + i % 3}", linewidth=1.2, label=label)


def rectangle(xy: tuple[float, float], width: float, height: float, **style: Any) -> Any:
    """A filled rectangle patch (for a grid of cells: ``ax.add_patch``, or a legend handle)."""
    from matplotlib.patches import Rectangle

    return Rectangle(xy, width, height, **style)


def save(fig: Any, path: Path, dpi: int = DPI, bottom: float = 0.0) -> Path:
    """Lay out ``fig`` (leaving the ``bottom`` fraction free, for a figure legend), write it to ``path`` at ``dpi``
    (creating its folder) and free it; return ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout(rect=(0, bottom, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
