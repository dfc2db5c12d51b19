"""``checkfreq plan`` and ``checkfreq simulate``: the interval each policy picks, and how they fare under failures."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from checkfreq.cli import app
from checkfreq.cli._output import JSON_HELP, console, emit_json, fitted_table, reports_errors
from checkfreq.policies import Overhead
from checkfreq.policies.intervals import daly, exact_optimum, overhead_steps, two_phase_interval, young, young_waste
from checkfreq.policies.losscurve import LossCurve
from checkfreq.tools import schedules
from checkfreq.tools.report import human_seconds
from checkfreq.tools.simulate import Result, Schedule, Workload, relative_change, simulate

HOUR = 3600.0
Seconds = Annotated[float, typer.Option(min=0.0)]


@app.command("plan")
@reports_errors
def plan_command(
    iteration: Annotated[float, typer.Option(help="Seconds per training iteration.", min=1e-9)],
    stall: Annotated[float, typer.Option(help="Seconds the loop is blocked per checkpoint.", min=0.0)],
    persist: Annotated[float, typer.Option(help="Seconds until a checkpoint is durable.", min=0.0)],
    mtbf_hours: Annotated[
        float | None, typer.Option(help="Job MTBF in hours (enables failure-aware policies).")
    ] = None,
    restart: Annotated[float, typer.Option(help="Seconds to restart and restore after a failure.", min=0.0)] = 120.0,
    p: Annotated[float, typer.Option(help="Overhead bound, as a fraction.")] = 0.035,
    as_json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """The interval each policy picks for the given costs, and its expected overhead."""
    if mtbf_hours is not None:
        _positive("--mtbf-hours", mtbf_hours)
    mtbf = None if mtbf_hours is None else mtbf_hours * HOUR
    floor = overhead_steps(iteration, stall, persist, Overhead.target * p) * iteration
    rows: dict[str, float] = {
        "CheckFreq (published, start)": max(math.ceil(persist / iteration), 1) * iteration,
        f"Overhead(p={p:g})": floor,
    }
    if mtbf is not None and stall > 0:
        rows["Young"] = max(young(stall, mtbf), persist)
        rows["Daly"] = two_phase_interval(stall, persist, mtbf)
        rows["exact (Lambert W)"] = max(exact_optimum(stall, mtbf), persist)
        rows["Auto"] = max(floor, daly(stall, mtbf), persist)
    else:
        rows["Auto"] = floor
    plans: list[dict[str, Any]] = [
        {
            "policy": name,
            "interval_s": tau,
            "interval_steps": max(round(tau / iteration), 1),
            "stall_overhead": stall / tau,
            "expected_overhead": None if mtbf is None else young_waste(tau, stall, mtbf, restart + persist),
        }
        for name, tau in rows.items()
    ]
    if as_json:
        emit_json({"plans": plans})
        return
    table = Table(title="Checkpoint interval per policy")
    for column in ("policy", "interval", "steps", "stall overhead", "expected overhead (failures too)"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for row in plans:
        expected = row["expected_overhead"]
        table.add_row(
            str(row["policy"]),
            human_seconds(row["interval_s"]),
            str(row["interval_steps"]),
            f"{row['stall_overhead']:.2%}",
            "-" if expected is None else f"{expected:.2%}",
        )
    console().print(table)


@app.command("simulate")
@reports_errors
def simulate_command(
    work_hours: Annotated[float, typer.Option(help="Failure-free training time W, hours.")] = 24.0,
    iteration: Annotated[float, typer.Option(help="Seconds per iteration.")] = 10.0,
    stall: Annotated[float, typer.Option(help="Blocking seconds per checkpoint (C_b).")] = 30.0,
    persist: Annotated[float, typer.Option(help="Seconds until durable (C_p).")] = 60.0,
    restart: Annotated[float, typer.Option(help="Restart cost R, seconds.")] = 120.0,
    mtbf_hours: Annotated[float, typer.Option(help="Job MTBF M, hours.")] = 4.0,
    gpus: Annotated[int, typer.Option(help="GPUs, for wasted GPU-hours.")] = 8,
    epoch_hours: Annotated[float, typer.Option(help="Hours per epoch (epoch-level policy).")] = 2.0,
    stop_probability: Annotated[float, typer.Option(help="Probability q of an early stop at U(0.4,0.6)·W.")] = 0.0,
    loss: Annotated[str, typer.Option(help="Loss curve a,b,w0,c of L(w)=a+b(w+w0)^-c, w in hours.")] = "0.2,2,0.1,0.5",
    p: Annotated[float, typer.Option(help="Overhead bound for Overhead and Auto.")] = 0.035,
    runs: Annotated[int, typer.Option(help="Paired Monte Carlo runs.", min=1)] = 2000,
    seed: Annotated[int, typer.Option(help="Random seed (common random numbers).")] = 0,
    plot: Annotated[Path | None, typer.Option(help="Also write a PNG of placement and overhead to this file.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """Compare checkpoint policies under Poisson failures: time overhead and value-weighted J.

    The header names the workload: W the failure-free training time, t_i the seconds per iteration,
    C_b the seconds a checkpoint blocks training, C_p the seconds until it is durable, R the restart
    cost, M the job's mean time between failures, q the probability of an early stop. J weighs the
    work a failure loses by ω, how fast the loss was falling while that work was done (1 on average
    over the run: without a loss curve J equals the time overhead).
    """
    for option, value in (
        ("--work-hours", work_hours),
        ("--iteration", iteration),
        ("--mtbf-hours", mtbf_hours),
        ("--epoch-hours", epoch_hours),
    ):
        _positive(option, value)
    for option, value in (("--stall", stall), ("--persist", persist), ("--restart", restart)):
        _non_negative(option, value)
    if gpus < 1:
        raise typer.BadParameter(f"{gpus} GPUs: give at least 1", param_hint="--gpus")
    if not 0.0 <= stop_probability <= 1.0:
        raise typer.BadParameter(
            f"{stop_probability:g} is no probability: give one in [0, 1]", param_hint="--stop-probability"
        )
    wl = Workload(
        work=work_hours * HOUR,
        iteration=iteration,
        stall=stall,
        persist=persist,
        restart=restart,
        mtbf=mtbf_hours * HOUR,
        gpus=gpus,
        epoch=epoch_hours * HOUR,
        stop_probability=stop_probability,
        loss=_loss(loss),
    )
    results = simulate(wl, _schedules(wl, p), runs=runs, seed=seed)
    change = relative_change(results, "Young")
    if plot is not None:
        _plot(results, wl, plot)
    if as_json:
        records = [
            {**r.as_dict(), "overhead_vs_young": change[r.name][0], "j_vs_young": change[r.name][1]} for r in results
        ]
        emit_json({"workload": _describe(wl), "results": records, "plot": None if plot is None else str(plot)})
        return
    columns = ("policy", "ckpts", "stall", "lost", "recovery", "time overhead", "vs Young", "GPU-h", "J", "J vs Young")
    rows = [
        (
            r.name,
            f"{r.checkpoints:.0f}",
            _min(r.stall),
            _min(r.lost),
            _min(r.recovery),
            _min(r.overhead),
            f"{change[r.name][0]:+.0%}",
            f"{r.gpu_hours:.1f}",
            _min(r.value_weighted),
            f"{change[r.name][1]:+.0%}",
        )
        for r in results
    ]
    out = console()
    out.print(f"{runs} paired runs: {_describe(wl)}", soft_wrap=True)
    out.print(LEGEND)
    out.print(fitted_table(columns, rows, wrap={"policy": 1}))
    out.print(
        "Minutes, mean per run. time overhead = stall + lost work + recovery; J = stall + recovery + lost work "
        "weighted by ω, how fast the loss was falling while that work was done (ω is 1 on average over the run).",
    )
    if plot is not None:
        out.print(f"plot: {plot}")


LEGEND = (
    "W: failure-free training time; t_i: seconds per iteration; C_b: seconds a checkpoint blocks training; "
    "C_p: seconds until it is durable; R: restart cost; M: job MTBF (mean time between failures); "
    "q: probability of an early stop"
)
"""What the header's letters stand for, printed under it."""


def _positive(option: str, value: float) -> None:
    """Refuse ``value`` for ``option`` unless it is a finite number above zero, naming the option."""
    if not (value > 0 and math.isfinite(value)):
        raise typer.BadParameter(f"{value:g} is not a positive number", param_hint=option)


def _non_negative(option: str, value: float) -> None:
    """Refuse ``value`` for ``option`` unless it is a finite number, zero or above, naming the option."""
    if not (value >= 0 and math.isfinite(value)):
        raise typer.BadParameter(f"{value:g} is not a number of zero or more", param_hint=option)


def _loss(spec: str) -> LossCurve:
    try:
        a, b, w0, c = (float(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"--loss wants four numbers a,b,w0,c, got {spec!r}") from None
    return LossCurve(a=a, b=b * HOUR**c, w0=w0 * HOUR, c=c)  # hours → seconds


def _schedules(wl: Workload, p: float) -> dict[str, Schedule]:
    return {
        "epoch-level": schedules.epoch_level(wl),
        "CheckFreq (published)": schedules.checkfreq_published(wl, p),
        "Young": schedules.young_daly(wl, "young"),
        "Daly": schedules.young_daly(wl, "daly"),
        f"Overhead({p:g})": schedules.overhead(wl, p),
        "Auto (MTBF known)": schedules.auto(wl, p, wl.mtbf),
        "COCI (published, min)": schedules.coci_published(wl),
        "convergence β=0.5": schedules.convergence_aware(wl, 0.5),
        "convergence β=1": schedules.convergence_aware(wl, 1.0),
        "convergence exact (DP)": schedules.convergence_optimal(wl),
    }


def _describe(wl: Workload) -> str:
    return (
        f"W={wl.work / HOUR:g} h, t_i={wl.iteration:g} s, C_b={wl.stall:g} s, C_p={wl.persist:g} s, "
        f"R={wl.restart:g} s, M={wl.mtbf / HOUR:g} h, {wl.gpus} GPUs, q={wl.stop_probability:g}"
    )


def _min(seconds: float) -> str:
    return f"{seconds / 60:.1f}"


def _plot(results: list[Result], wl: Workload, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.5 * len(results) + 2), gridspec_kw={"width_ratios": [3, 2]})
    names = [r.name for r in results]
    for row, r in enumerate(results):
        hours = r.placement[r.placement < wl.work] / HOUR
        left.vlines(hours, row - 0.35, row + 0.35, linewidth=0.6)
    left.set_yticks(range(len(names)), names)
    left.set_xlim(0, wl.work / HOUR)
    left.set_xlabel("training progress (h); relative schedules shown from the start")
    left.set_title("checkpoint placement")
    left.invert_yaxis()
    parts = {
        "stall": [r.stall for r in results],
        "lost work": [r.lost for r in results],
        "recovery": [r.recovery for r in results],
    }
    start = [0.0] * len(results)
    for label, values in parts.items():
        minutes = [v / 60 for v in values]
        right.barh(range(len(names)), minutes, left=start, label=label)
        start = [s + m for s, m in zip(start, minutes, strict=True)]
    right.scatter(
        [r.value_weighted / 60 for r in results], range(len(names)), color="black", marker="D", s=14, label="J"
    )
    right.set_yticks(range(len(names)), [""] * len(names))
    right.invert_yaxis()
    right.set_xscale("log")
    right.set_xlabel("minutes (mean per run)")
    right.set_title("time overhead and value-weighted J")
    right.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
