"""The loss curve of a DDP job that loses half its ranks and gets them back, against an uninterrupted one.

Usage: ``python benchmarks/elastic_curve.py [--out docs/elastic.png]``

Runs ``tests/scripts/elastic_train.py`` (CPU, gloo) three times over the same data:

* uninterrupted at world size 4, global batches of 32;
* the same job SIGKILLed at 4 ranks, resumed at 2 (each rank's 16 samples of a step handed out as
  2 micro-batches of 8) and finished at 4 again;
* that resize with per-rank batches of 8 instead (``batch_size=8``: global batches of 32 at 4
  ranks, 16 at 2), as a job without ``global_batch_size`` runs.

Plots the loss of each optimizer step's global batch for the three, and how far each resized
curve is from the uninterrupted one, and prints the largest differences.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "scripts"))

from elastic_train import command, read_steps, step_samples  # noqa: E402

SAMPLES, GLOBAL_BATCH, EPOCHS, EVERY = 1536, 32, 3, 10
DIE, SHRUNK_UNTIL = 45, 90  # killed after step 45 (restored at 40); at 2 ranks from there to step 90


def run(work: Path, nproc: int, log: str, *extra: str, check: bool = True) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT / "src")])),
    }
    args = [
        "--ckpt-dir",
        str(work / "ckpt"),
        "--final",
        str(work / "final.pt"),
        "--step-log",
        str(work / log),
        "--samples",
        str(SAMPLES),
        "--global-batch",
        str(GLOBAL_BATCH),
        "--epochs",
        str(EPOCHS),
        "--every",
        str(EVERY),
        *extra,
    ]
    done = subprocess.run(command(nproc, *args), env=env, capture_output=True, text=True, timeout=600)
    if check and done.returncode:
        raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])


def resized(work: Path, *batches: str, micro: tuple[str, ...] = ()) -> dict:
    run(work, 4, "a.log", "--die", f"0:{DIE}", *batches, check=False)
    run(work, 2, "b.log", "--stop-at", str(SHRUNK_UNTIL), *batches, *micro)
    run(work, 4, "c.log", *batches)
    return read_steps(work / "a.log", work / "b.log", work / "c.log")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "docs" / "elastic.png"))
    out = Path(parser.parse_args().out)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        for name in ("uninterrupted", "global", "per_rank"):
            (base / name).mkdir()
        run(base / "uninterrupted", 4, "a.log")
        curves = {
            "uninterrupted": read_steps(base / "uninterrupted" / "a.log"),
            "global": resized(base / "global", micro=("--micro", "8")),
            "per_rank": resized(base / "per_rank", "--batch-size", "8"),
        }
    reference = curves["uninterrupted"]
    same = step_samples(curves["global"]) == step_samples(reference)
    print(f"global_batch_size: the same samples at every one of {len(reference)} steps: {same}")
    for name in ("global", "per_rank"):
        common = sorted(set(curves[name]) & set(reference))
        worst = max(abs(curves[name][s][0][0] - reference[s][0][0]) for s in common)
        print(f"{name}: {len(curves[name])} steps, largest loss difference to the uninterrupted run {worst:.3g}")
    plot(curves, out)
    print(f"wrote {out}")


def plot(curves: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {
        "uninterrupted": ("uninterrupted, 4 ranks", "black", "-", 3.0),
        "global": ("resized, global_batch_size=32", "tab:orange", "--", 1.5),
        "per_rank": ("resized, batch_size=8 per rank", "tab:blue", ":", 1.2),
    }
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, height_ratios=(3, 2))
    for ax in (top, bottom):
        ax.axvspan(DIE - DIE % EVERY, SHRUNK_UNTIL, color="0.92")
    top.text(
        (DIE - DIE % EVERY + SHRUNK_UNTIL) / 2,
        0.97,
        "2 ranks",
        ha="center",
        va="top",
        transform=top.get_xaxis_transform(),
        fontsize=9,
    )
    reference = curves["uninterrupted"]
    for name, steps in curves.items():
        label, color, style, width = styles[name]
        xs = sorted(steps)
        top.plot(xs, [steps[s][0][0] for s in xs], style, color=color, linewidth=width, label=label)
        if name != "uninterrupted":
            common = [s for s in xs if s in reference]
            gaps = [max(abs(steps[s][0][0] - reference[s][0][0]), 1e-9) for s in common]
            bottom.semilogy(common, gaps, style, color=color, linewidth=width, label=label)
    top.set_ylabel("loss of the step's global batch")
    top.set_title("4 ranks, killed after step 45, resumed at 2 ranks from step 40, at 4 again from step 90")
    top.legend(fontsize=8)
    bottom.set_ylabel("|difference| to uninterrupted\n(none: drawn at 1e-9)")
    bottom.set_xlabel("optimizer step")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
