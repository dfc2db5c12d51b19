"""Markdown tables and a PNG from the analysed results, spliced into ``docs/performance.md``."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks import analysis as an
from benchmarks.stats import fmt_with_spread, median, spread

BEGIN = "<!-- benchmark results: begin (written by python -m benchmarks.run) -->"
END = "<!-- benchmark results: end -->"


def print_rows(table: str, rows: Sequence[Any], json_path: str | None) -> None:
    """Print a benchmark's Markdown ``table``; with ``json_path``, also write its ``rows`` (dataclasses) there."""
    print(table)
    if json_path:
        with open(json_path, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)


def _gbps(values: list[float]) -> str:
    lo, hi = spread(values)
    if not math.isfinite(lo):
        return "–"
    return f"{median(values) / 1e9:.2f} ({lo / 1e9:.2f}–{hi / 1e9:.2f})"


def state_table(result: dict[str, Any]) -> list[str]:
    """One row per method: stall, time to durable, bandwidth, and ratios to the limits."""
    copy = an.field(result, an.RAW_COPY, "stall")
    write_bw = an.bandwidth(result, an.RAW_WRITE)
    lines = [
        f"#### State of {result['nbytes'] / 1e6:.0f} MB ({result['tensors']} tensors)",
        "",
        "| method | kind | stall: median (min–max) | stall ÷ raw copy_ | time to durable | GB/s (write or read) "
        "| ÷ limit |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for entry in result["methods"]:
        name, kind = entry["name"], entry["kind"]
        if name in result["errors"]:
            lines.append(f"| {name} | {kind} | failed: {result['errors'][name]} | | | | |")
            continue
        stall = an.field(result, name, "stall")
        durable = an.field(result, name, "durable")
        bw = an.bandwidth(result, name)
        if name in an.RAW_READ.values() or name in an.RESTORE.values():
            cache = "cold" if "cold" in name else "hot"
            limit = an.per_round(an.field(result, an.RAW_READ[cache], "stall"), stall)
            stall_ratio = "–"
        else:
            limit = an.per_round(bw, write_bw) if any(math.isfinite(d) for d in durable) else []
            stall_ratio = an.fmt_range(an.per_round(stall, copy), suffix="×")
        lines.append(
            f"| {name} | {kind} | {fmt_with_spread(stall)} | {stall_ratio} | {fmt_with_spread(durable)} | "
            f"{_gbps(bw)} | {an.fmt_range(limit, suffix='×') if limit else '–'} |"
        )
    return lines


def targets_table(targets: list[an.Target]) -> list[str]:
    lines = ["| target | measured: median (min–max over rounds) | bound | met |", "| --- | --- | --- | --- |"]
    for t in targets:
        met = {True: "yes", False: "**no**", None: "–"}[t.met]
        lines.append(f"| {t.what} | {an.fmt_range(t.values)} | {'≥' if t.at_least else '≤'} {t.bound:g} | {met} |")
    return lines


def loop_table(training: dict[str, Any], rows: list[an.LoopRow]) -> list[str]:
    runs = training["runs"]["no checkpoints"]
    base = [an.mean_iteration(r) for r in runs]
    lines = [
        f"MLP of {training['params'] / 1e6:.1f} M parameters ({training['state_bytes'] / 1e6:.0f} MB with Adam), "
        f"batch {training['batch']}, {training['steps']} steps per run (a quarter of that for synchronous "
        f"baselines at every step); {len(runs)} no-checkpoint runs interleaved with the variants, "
        f"mean iteration {fmt_with_spread(base)} (median and range over those runs); overheads are "
        f"per run against the no-checkpoint runs just before and after it.",
        "",
        "| variant | checkpoints per run | whole-run overhead: median (min–max) "
        "| stall per checkpoint: median (min–max) | iteration slowdown while persisting |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row.name} | {row.checkpoints:g} | {an.fmt_range(row.overhead, 100, ' %')} | "
            f"{fmt_with_spread(row.stalls)} | {an.fmt_range(row.persisting_slowdown, 100, ' %')} |"
        )
    return lines


def memory_line(memory: dict[str, float]) -> str:
    return (
        f"Peak extra RSS (fresh process, `VmHWM` reset after building the state): saving "
        f"{memory['save_peak_extra'] / 1e6:.0f} MB, restoring {memory['restore_peak_extra'] / 1e6:.0f} MB, "
        f"for a state of {memory['nbytes'] / 1e6:.0f} MB."
    )


def gpu_lines(gpu: dict[str, Any]) -> list[str]:
    if "skipped" in gpu:
        return [f"GPU mode skipped: {gpu['skipped']}."]
    lines = [
        f"Device: {gpu['device']}; state {gpu['nbytes'] / 1e9:.2f} GB on the GPU.",
        "",
        "| measurement | median (min–max) |",
        "| --- | --- |",
    ]
    for name, values in gpu["seconds"].items():
        lines.append(f"| {name} | {fmt_with_spread(values)} |")
    for name, values in gpu["ratios"].items():
        lines.append(f"| {name} | {an.fmt_range(values, suffix='×')} |")
    return lines


def render(results: dict[str, Any], png_name: str | None) -> str:
    """The whole generated section (between the markers)."""
    env = results["environment"]
    out = [BEGIN, "", f"Run of {results['date']}: {env}.", ""]
    if results.get("failed"):
        out += [f"Failed in this run (see its log): {'; '.join(results['failed'])}.", ""]
    for key, result in results["states"].items():
        out += state_table(result) + [""]
        memory = results["memory"].get(key)
        if memory:
            out += [memory_line(memory), ""]
        out += ["Targets:", ""] + targets_table(an.state_targets(result, memory)) + [""]
    if results.get("training"):
        rows = an.loop_rows(results["training"])
        out += ["#### Training loop", ""] + loop_table(results["training"], rows) + [""]
        auto = an.auto_target(rows)
        if auto:
            out += targets_table([auto]) + [""]
    if results.get("gpu"):
        out += ["#### GPU mode", ""] + gpu_lines(results["gpu"]) + [""]
    if png_name:
        out += [f"![stall, bandwidth and loop overhead]({png_name})", ""]
    out.append(END)
    return "\n".join(out)


def splice(doc: Path, section: str) -> None:
    """Replace the generated section of ``doc`` (or create ``doc`` holding just that section)."""
    text = doc.read_text() if doc.exists() else "# Performance\n\n" + BEGIN + "\n" + END + "\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        text = head + section + tail
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    doc.write_text(text)


def plot(results: dict[str, Any], path: Path) -> None:
    """Stall per method and size (log scale), write bandwidth, and loop overhead per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    states = results["states"]
    if not states:
        return
    panels = 3 if results.get("training") else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 5.5))
    readers = {*an.RAW_READ.values(), *an.RESTORE.values()}
    writers = [m["name"] for m in next(iter(states.values()))["methods"] if m["name"] not in readers]
    width = 0.8 / max(len(states), 1)
    for k, (_key, result) in enumerate(states.items()):
        xs = [i + k * width for i in range(len(writers))]
        label = f"{result['nbytes'] / 1e6:.0f} MB"
        axes[0].barh(xs, [median(an.field(result, n, "stall")) for n in writers], height=width, label=label)
        axes[1].barh(xs, [median(an.bandwidth(result, n)) / 1e9 for n in writers], height=width, label=label)
    for ax, title in ((axes[0], "stall per checkpoint (s, log)"), (axes[1], "write bandwidth to durable (GB/s)")):
        ax.set_yticks([i + width * (len(states) - 1) / 2 for i in range(len(writers))], writers, fontsize=8)
        ax.set_title(title)
        ax.invert_yaxis()
        ax.legend(fontsize=8)
    axes[0].set_xscale("log")
    if results.get("training"):
        rows = an.loop_rows(results["training"])
        axes[2].barh([r.name for r in rows], [max(median(r.overhead), 1e-4) * 100 for r in rows])
        axes[2].set_xscale("log")
        axes[2].set_title("training loop: whole-run overhead (%, log)")
        axes[2].tick_params(axis="y", labelsize=8)
        axes[2].invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
