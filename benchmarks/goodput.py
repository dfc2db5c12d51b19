"""Goodput under failures: a job of two torchrun agents of two ranks each (``--nnodes 2``, c10d on
127.0.0.1, each agent its own shared memory) trains for a fixed wall time while a seeded driver
SIGKILLs a random rank, or a whole node (node 1: its agent and workers, its memory wiped, a
replacement agent started), about once every ``--mtbf`` seconds, each kill only once the job trains
again after the one before.

Variants, interleaved within each repeat (``benchmarks/goodput_job.py`` says what each does):
checkfreq with ``memory=1`` and ``replicas=1``; checkfreq disk only; ``torch.save`` every 500 steps;
DCP ``async_save`` every 50 steps; and ``none``, no checkpoint and no failure: the reference.

Goodput = (the step the job reached) × (the reference's fault-free step time) / (the wall time from
launch to the deadline). Each failure is broken down (``benchmarks/goodput_breakdown.py``); each run's
final state is compared with the reference's at the same step (its digest): bit-identical or not.

    python -m benchmarks.goodput                               # 10 minutes a variant, a failure a minute
    python -m benchmarks.goodput --seconds 90 --mtbf 30 --variants checkfreq-memory none --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from benchmarks.goodput_breakdown import PHASES, Failure, failures, read_marks, step_seconds
from benchmarks.goodput_plot import plot
from benchmarks.report import print_rows

JOB = Path(__file__).with_name("goodput_job.py")
VARIANTS = ("checkfreq-memory", "checkfreq-disk", "torch-save", "dcp-async", "none")
EVERY = {"torch-save": 500, "dcp-async": 50}
"""Steps between saves of the baselines: the usual habit of each."""
REFERENCE = "none"
GRACE_S = 120.0
"""Seconds a job may take past its deadline to stop (its last saves, its agents' exit)."""


@dataclass
class Run:
    """One variant's run: what the job reached, each failure, and the final state's verdict."""

    variant: str
    repeat: int
    wall_s: float
    steps: int
    goodput: float
    identical: bool | None
    """The final state equals the reference's at the same step (None: no reference at that step)."""
    finished: bool
    """The job ended by the deadline's grace; False: it was stopped (a hang after a kill)."""
    failures: list[dict[str, Any]] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _agent(work: Path, node: int, port: int, variant: str, deadline: float) -> subprocess.Popen[bytes]:
    """One torchrun agent of two ranks on 127.0.0.<node+1>; node 0 hosts the rendezvous store."""
    shm = work / f"shm{node}"
    shm.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "CHECKFREQ_SHM_DIR": str(shm),
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--local-addr",
        f"127.0.0.{node + 1}",
        "--rdzv-conf",
        f"last_call_timeout=1,is_host={int(node == 0)}",
        "--max-restarts",
        "1000",
        "--monitor-interval",
        "0.1",
        str(JOB),
        "--mode",
        variant,
        "--dir",
        str(work / "ckpt"),
        "--marks",
        str(work / "marks"),
        "--deadline",
        str(deadline),
        "--every",
        str(EVERY.get(variant, 500)),
        *(["--digests"] if variant == REFERENCE else []),
    ]
    log = (work / f"node{node}.out").open("ab")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _worker(agents: list[subprocess.Popen[bytes]], rank: int) -> psutil.Process | None:
    for agent in agents:
        try:
            for child in psutil.Process(agent.pid).children(recursive=True):
                if JOB.name in " ".join(child.cmdline()) and child.environ().get("RANK") == str(rank):
                    return child
        except psutil.Error:
            continue
    return None


def _training_since(marks: Path, since: float) -> bool:
    """Rank 0 restored after ``since`` and marked a step since: the job trains again (a survivor's
    steps just after a kill, before it finds the loss, do not count)."""
    path = marks / "rank0.jsonl"
    if not path.exists():
        return False
    restored = False
    for line in path.read_text().splitlines():
        mark = json.loads(line)
        if mark["t"] > since and mark["phase"] == "restored":
            restored = True
        elif restored and mark["phase"] == "step":
            return True
    return False


def _kill_group(agent: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(agent.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    agent.wait()


def run_variant(
    work: Path, variant: str, seconds: float, mtbf: float, node_share: float, rng: random.Random
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float, float]:
    """Run ``variant`` for ``seconds``, killing as the module docstring says (never the reference);
    its marks, its kills, its launch time and its deadline. A job still running ``GRACE_S`` after the
    deadline is stopped, the tail of its log printed to stderr."""
    launch = time.time()
    deadline = launch + seconds
    port = _free_port()
    agents = [_agent(work, node, port, variant, deadline) for node in (0, 1)]
    kills: list[dict[str, Any]] = []
    try:
        since = launch
        while variant != REFERENCE:
            at = time.time() + rng.expovariate(1 / mtbf)
            while time.time() < deadline and not (time.time() >= at and _training_since(work / "marks", since)):
                time.sleep(0.05)
            if time.time() >= deadline - 5:
                break
            if rng.random() < node_share:
                _kill_group(agents[1])
                shutil.rmtree(work / "shm1", ignore_errors=True)  # the node's memory goes with it
                kills.append({"t": time.time(), "kind": "node"})
                agents[1] = _agent(work, 1, port, variant, deadline)  # its replacement
            else:
                victim = _worker(agents, rng.randrange(4))
                if victim is None:
                    continue
                victim.kill()
                kills.append({"t": time.time(), "kind": "rank"})
            since = kills[-1]["t"]
        for agent in agents:
            try:
                agent.wait(timeout=max(1.0, deadline + GRACE_S - time.time()))
            except subprocess.TimeoutExpired:
                tail = (work / "node0.out").read_text(errors="replace")[-3000:]
                print(
                    f"{variant}: the job still ran {GRACE_S:.0f} s after its deadline; stopped. Its log:\n{tail}",
                    file=sys.stderr,
                )
                break
    finally:
        for agent in agents:
            _kill_group(agent)
    return read_marks(work / "marks"), kills, launch, deadline


def _final(marks: list[dict[str, Any]]) -> tuple[int, str | None]:
    end = next((m for m in reversed(marks) if m["phase"] == "end" and m["rank"] == 0), None)
    if end is not None:
        return int(end["step"]), str(end["digest"])
    steps = [m["step"] for m in marks if m["phase"] == "step"]
    return (max(steps) if steps else 0), None


def measure(variants: list[str], seconds: float, mtbf: float, node_share: float, repeats: int, seed: int) -> list[Run]:
    """Every variant's runs, interleaved (the reference first in each repeat, the others rotated)."""
    rng = random.Random(seed)
    runs: list[Run] = []
    others = [v for v in variants if v != REFERENCE]
    for repeat in range(repeats):
        order = [REFERENCE, *others[repeat % max(1, len(others)) :], *others[: repeat % max(1, len(others))]]
        measured: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]], float, float]] = {}
        for variant in order:
            with tempfile.TemporaryDirectory(prefix=f"goodput-{variant}-") as work:
                measured[variant] = run_variant(Path(work), variant, seconds, mtbf, node_share, rng)
        reference_marks = measured[REFERENCE][0]
        step_s = step_seconds(reference_marks)
        digests = {m["step"]: m["digest"] for m in reference_marks if m["phase"] == "step" and "digest" in m}
        for variant in order:
            if variant not in variants:
                continue
            marks, kills, launch, deadline = measured[variant]
            steps, final = _final(marks)
            finished = final is not None
            identical = None if final is None or steps not in digests else final == digests[steps]
            costs = failures(marks, kills, step_s)
            runs.append(
                Run(
                    variant,
                    repeat,
                    deadline - launch,
                    steps,
                    steps * step_s / (deadline - launch),
                    identical,
                    finished,
                    [_row(f) for f in costs],
                )
            )
    return runs


def _row(failure: Failure) -> dict[str, Any]:
    return {
        "kind": failure.kind,
        "replayed": failure.replayed,
        "back_s": failure.back_s,
        "cost_s": failure.cost_s,
        **failure.seconds,
    }


def table(runs: list[Run]) -> str:
    """One row per variant: goodput, failures, steps replayed, kill to training, a failure's cost, the final state."""
    lines = [
        "| variant | goodput: median (min–max) | failures | steps replayed: median, max "
        "| kill → training: median, p95 | a failure's cost (median) | final state |",
        "| --- | ---: | ---: | --- | --- | ---: | --- |",
    ]
    for variant in dict.fromkeys(r.variant for r in runs):
        mine = [r for r in runs if r.variant == variant]
        goodputs = [r.goodput for r in mine]
        rows = [f for r in mine for f in r.failures]
        replayed = [f["replayed"] for f in rows if f["replayed"] is not None]
        back = sorted(f["back_s"] for f in rows if f["back_s"] is not None)
        cost = [f["cost_s"] for f in rows if f["cost_s"] is not None]
        verdicts = {r.identical for r in mine}
        final = "bit-identical" if verdicts == {True} else "differs" if False in verdicts else "–"
        if not all(r.finished for r in mine):
            final = f"{sum(not r.finished for r in mine)} of {len(mine)} hung after a kill"
        lines.append(
            f"| {variant} | {statistics.median(goodputs):.1%} ({min(goodputs):.1%}–{max(goodputs):.1%}) | {len(rows)} "
            f"| {_median(replayed, '{:.0f}')}, {max(replayed, default='–')} "
            f"| {_median(back, '{:.1f} s')}, {_p95(back)} | {_median(cost, '{:.1f} s')} | {final} |"
        )
    return "\n".join(lines)


def breakdown(runs: list[Run]) -> str:
    """Each variant's mean seconds a failure spends in each phase."""
    lines = ["| variant | " + " | ".join(PHASES) + " |", "| --- |" + " ---: |" * len(PHASES)]
    for variant in dict.fromkeys(r.variant for r in runs if r.failures):
        rows = [f for r in runs if r.variant == variant for f in r.failures]
        cells = [_median([f[p] for f in rows if p in f], "{:.2f}") for p in PHASES]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _median(values: list[float], fmt: str) -> str:
    return fmt.format(statistics.median(values)) if values else "–"


def _p95(values: list[float]) -> str:
    return f"{values[min(len(values) - 1, int(0.95 * len(values)))]:.1f} s" if values else "–"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=600.0, help="wall time of each run")
    parser.add_argument("--mtbf", type=float, default=60.0, help="mean seconds between kills")
    parser.add_argument("--node-share", type=float, default=0.3, help="the share of kills that take a whole node")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write every run's rows here")
    parser.add_argument("--png", default=None, help="draw each variant's failure breakdown here")
    args = parser.parse_args(argv)
    variants = list(dict.fromkeys([*args.variants, REFERENCE]))
    runs = measure(variants, args.seconds, args.mtbf, args.node_share, args.repeats, args.seed)
    print_rows(
        table(runs) + "\n\nSeconds a failure spends in each phase (median):\n\n" + breakdown(runs), runs, args.json
    )
    if args.png:
        plot([asdict(run) for run in runs], args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
