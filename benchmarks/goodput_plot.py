"""The picture of ``benchmarks.goodput``'s results: for each variant, a bar of the median seconds a
failure spends in each phase, stacked in order, beside its goodput.

    python -m benchmarks.goodput_plot out.json docs/goodput.png   # from a run's --json
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any

from benchmarks.goodput_breakdown import PHASES


def plot(runs: list[dict[str, Any]], path: str) -> None:
    """Draw ``runs`` (a run's ``--json`` rows) into the PNG ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = [
        v for v in dict.fromkeys(r["variant"] for r in runs) if any(r["failures"] for r in runs if r["variant"] == v)
    ]
    figure, axes = plt.subplots(figsize=(9, 0.9 * len(variants) + 1.6))
    for row, variant in enumerate(variants):
        failures = [f for r in runs if r["variant"] == variant for f in r["failures"]]
        goodput = statistics.median(r["goodput"] for r in runs if r["variant"] == variant)
        left = 0.0
        for index, phase in enumerate(PHASES):
            seconds = [f[phase] for f in failures if f.get(phase) is not None]
            width = statistics.median(seconds) if seconds else 0.0
            axes.barh(row, width, left=left, color=f"C{index}", label=phase if row == 0 else None)
            left += width
        axes.text(left + 0.1, row, f"goodput {goodput:.0%}", va="center", fontsize=9)
    axes.set_yticks(range(len(variants)), variants)
    axes.invert_yaxis()
    axes.set_xlabel("seconds a failure costs (median of each phase; replay at the fault-free step time)")
    axes.legend(ncol=len(PHASES), fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    axes.set_xlim(right=axes.get_xlim()[1] * 1.15)  # room for the goodput beside the longest bar
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        plot(json.load(f), sys.argv[2])
