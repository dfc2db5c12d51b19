"""Fault-injection campaign: SIGKILL a real training job, restart it, and check what survived.

Each *run* trains ``tests/scripts/chaos_train.py`` to the end in one checkpoint directory while
being killed (SIGKILL) up to ``--kills-per-run`` times; after every kill it is started again and
resumes from what it finds. A kill lands either at a random instant of the training (``compute``:
whatever the process was doing, persist included) or, through the script's test hooks, inside
a named phase of a checkpoint: ``snapshot``, ``copy``, ``write``, ``fsync``, ``rename``,
``retention``. After each kill every visible checkpoint is read back and verified; at the end of
each run its final state is compared, bit for bit (SHA-256), with an uninterrupted run.

With ``--memory N`` the job also snapshots into the memory tier every N steps, and kills land
in memory snapshots too (``snapshot`` and ``copy`` hit them mid-copy; ``header`` after the copy,
before the slot header). After each kill the newest complete state of any tier is noted, and
the restart must restore exactly that step.

Jobs are forked from this process after torch is imported (a fresh interpreter costs seconds
of imports on a loaded machine); each is a separate process killed with a real SIGKILL.

    python benchmarks/chaos.py                     # full campaign (>= 200 kills), updates docs/reliability.md
    python benchmarks/chaos.py --kills 30 --json out.json --no-report   # the short CI version
    python benchmarks/chaos.py --memory 1          # the campaign with the memory tier
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # no thread pools in this process: it forks

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections import Counter  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from checkfreq.errors import CheckfreqError  # noqa: E402
from checkfreq.pipeline.restore import read_checkpoint  # noqa: E402
from checkfreq.run.events import read_events  # noqa: E402
from checkfreq.storage.format import checkpoint_step  # noqa: E402
from checkfreq.tools.catalog import memory_snapshots  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "docs" / "reliability.md"
_spec = importlib.util.spec_from_file_location("chaos_train", ROOT / "tests" / "scripts" / "chaos_train.py")
chaos_train = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(chaos_train)  # type: ignore[union-attr]

PHASES = ("compute", "compute", *chaos_train.PHASES)  # random instants weigh double
MEMORY_PHASES = (*PHASES, *chaos_train.MEMORY_PHASES)
PER_CHECKPOINT = {"snapshot": 1, "copy": 1, "write": 2, "fsync": 4, "rename": 2, "retention": 1, "header": 1}
"""About how often each hooked phase occurs per checkpoint (to spread kills over a run)."""
MEMORY_SCALED = {"snapshot", "copy", "header"}
"""Phases that every memory snapshot goes through too: with ``--memory 1``, once per step."""
ATTEMPT_TIMEOUT_S = 180.0


@dataclass
class Attempt:
    """One process: started, resumed, and killed or finished."""

    phase: str | None
    killed: bool = False
    restored: int | None = None
    last_step: int = 0
    reached: str | None = None
    final: str | None = None
    exit_code: int | None = None
    hung: bool = False
    seconds: float = 0.0


@dataclass
class Results:
    kills: int = 0
    kills_by_phase: Counter = field(default_factory=Counter)
    restarts: int = 0
    restores_from_checkpoint: int = 0
    fresh_starts_after_kill: int = 0
    unrestorable: int = 0
    kills_during_startup: int = 0
    visible_checkpoints_verified: int = 0
    visible_checkpoints_corrupt: int = 0
    runs: int = 0
    runs_bit_identical: int = 0
    runs_different: int = 0
    runs_failed: int = 0
    hangs: int = 0
    lost_steps: list[int] = field(default_factory=list)
    restores_from_memory: int = 0
    restores_not_newest: int = 0
    """Restarts that did not restore the newest complete state of any tier (memory or disk)."""
    memory: int = 0
    """The memory tier's cadence in steps (0: off)."""
    interval: int = 0
    steps_per_run: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def max_lost(self) -> int:
        return max(self.lost_steps, default=0)

    def summary(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["kills_by_phase"] = dict(sorted(self.kills_by_phase.items()))
        doc["max_lost_steps"] = self.max_lost
        doc["mean_lost_steps"] = sum(self.lost_steps) / len(self.lost_steps) if self.lost_steps else 0.0
        doc["lost_bound_steps"] = 2 * self.interval
        del doc["lost_steps"]
        return doc


def start(train_args: list[str], log: Path) -> tuple[int, int]:
    """Fork a training process; return (pid, read end of its progress pipe)."""
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        os.close(w)
        return pid, r
    code = 1
    try:
        os.close(r)
        err = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(err, 1)
        os.dup2(err, 2)
        chaos_train.run(chaos_train.parse([*train_args, "--progress-fd", str(w)]))
        code = 0
    except BaseException:  # noqa: BLE001 - the parent reads the log
        traceback.print_exc()
    finally:
        os._exit(code)


def attempt(train_args: list[str], log: Path, phase: str | None, delay: float | None) -> Attempt:
    """Run one process; SIGKILL it when its hook is reached or ``delay`` s after it is ready."""
    result = Attempt(phase)
    began = time.monotonic()
    pid, fd = start(train_args, log)
    limit, kill_at, buffer = began + ATTEMPT_TIMEOUT_S, None, b""

    def kill() -> None:
        if not result.killed:
            result.killed = True
            os.kill(pid, signal.SIGKILL)

    while True:
        now = time.monotonic()
        if now >= limit:
            result.hung = True
            kill()
        if kill_at is not None and now >= kill_at:
            kill()
        wait = min(limit, kill_at or limit) - now
        if not select.select([fd], [], [], max(wait, 0.0))[0]:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        *lines, buffer = (buffer + chunk).split(b"\n")
        for line in lines:
            word, *rest = line.decode().split()
            if word == "ready":
                result.restored = int(rest[0])
                if delay is not None:
                    kill_at = time.monotonic() + delay
            elif word == "step":
                result.last_step = int(rest[0])
            elif word == "chaos":
                result.reached = rest[0]
                kill()
            elif word == "final":
                result.final = rest[0]
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    result.exit_code = os.waitstatus_to_exitcode(status)
    result.killed = result.killed and result.exit_code == -signal.SIGKILL
    result.seconds = time.monotonic() - began
    return result


def verify_visible(directory: Path, results: Results) -> int:
    """Read back every committed checkpoint (a kill must never leave a broken one visible) and
    the memory tier's snapshots; return the newest complete step of any tier (0: none)."""
    if not directory.exists():
        return 0
    newest = 0
    for path in sorted(directory.iterdir()):
        if checkpoint_step(path.name) is None:
            continue
        try:
            manifest, _ = read_checkpoint(path)
            results.visible_checkpoints_verified += 1
            newest = max(newest, manifest.step)
        except CheckfreqError as e:
            results.visible_checkpoints_corrupt += 1
            results.problems.append(f"{path}: {e}")
    return max([newest] + [s.step for s in memory_snapshots(directory) if s.valid])


def draw(deck: list[str], rng: random.Random, memory: bool) -> str:
    """The next phase to kill in: every phase comes up once per shuffled deck."""
    if not deck:
        deck.extend(MEMORY_PHASES if memory else PHASES)
        rng.shuffle(deck)
    return deck.pop()


def one_run(
    workdir: Path,
    index: int,
    base: list[str],
    reference: Attempt,
    results: Results,
    rng: random.Random,
    deck: list[str],
    kills_per_run: int,
    compute_span: float,
) -> None:
    """Train one run to the end through up to ``kills_per_run`` kills."""
    directory, log = workdir / f"run{index:03d}", workdir / f"run{index:03d}.log"
    args = [*base, "--dir", str(directory)]
    killed_last: Attempt | None = None
    kills, newest_complete = 0, 0
    while True:
        phase = draw(deck, rng, bool(results.memory)) if kills < kills_per_run else None
        extra: list[str] = []
        delay = None
        done = killed_last.last_step if killed_last else 0
        if phase == "compute":
            delay = rng.uniform(0.0, compute_span * (1 - done / results.steps_per_run))
        elif phase is not None:
            left = max(1, (results.steps_per_run - done) // results.interval)
            per_checkpoint = PER_CHECKPOINT[phase] * (
                results.interval if phase in MEMORY_SCALED and results.memory else 1
            )
            extra = ["--hook", phase, "--hook-at", str(rng.randint(1, per_checkpoint * left))]
        a = attempt(args + extra, log, phase, delay)
        if kills:
            results.restarts += 1
        if a.hung:
            results.hangs += 1
            results.problems.append(f"run {index}: a process hung (phase {phase}); see {log}")
        if a.restored is None and not a.killed:
            results.unrestorable += 1
            results.problems.append(f"run {index}: restart failed before resuming (exit {a.exit_code}); see {log}")
            return
        if a.restored is not None and killed_last is not None:
            if a.restored:
                results.restores_from_checkpoint += 1
            else:
                results.fresh_starts_after_kill += 1
            results.lost_steps.append(max(0, killed_last.last_step - a.restored))
            results.restores_from_memory += _restored_from_memory(directory)
            if a.restored != newest_complete:
                results.restores_not_newest += 1
                results.problems.append(
                    f"run {index}: restored step {a.restored}, the newest complete state was "
                    f"step {newest_complete}; see {log}"
                )
        if a.killed:
            kills += 1
            results.kills += 1
            results.kills_by_phase[a.reached or "compute"] += 1
            results.kills_during_startup += a.restored is None
            newest_complete = verify_visible(directory, results)
            if a.restored is not None:  # killed while starting: the work at stake is still the previous run's
                killed_last = a
            continue
        if a.final is None:
            results.runs_failed += 1
            results.problems.append(f"run {index}: exited {a.exit_code} without finishing; see {log}")
            return
        results.runs += 1
        if a.final == reference.final:
            results.runs_bit_identical += 1
        else:
            results.runs_different += 1
            results.problems.append(f"run {index}: final state differs from the uninterrupted run")
        return


def _restored_from_memory(directory: Path) -> bool:
    """Whether the directory's latest restore read the memory tier (from its event log)."""
    restores = [e for e in read_events(directory) if e.get("event") == "restore"]
    return bool(restores) and restores[-1].get("tier") == "memory"


def warm_up(base: list[str], workdir: Path) -> None:
    """Train once in this process, so that every forked job starts with torch's lazy setup done."""
    with open(os.devnull, "wb") as sink:
        chaos_train.run(
            chaos_train.parse([*base, "--dir", str(workdir / "warm-up"), "--progress-fd", str(sink.fileno())])
        )
    threads = len(os.listdir("/proc/self/task")) if Path("/proc/self/task").exists() else 1
    if threads != 1:
        print(f"warning: {threads} threads before forking; forked jobs may inherit a held lock", file=sys.stderr)


def campaign(
    kills: int, kills_per_run: int, seed: int, workdir: Path, every: int, epochs: int, memory: int = 0
) -> Results:
    rng = random.Random(seed)
    base = ["--every", str(every), "--epochs", str(epochs), "--keep", "2", "--memory", str(memory)]
    warm_up(base, workdir)
    started = time.monotonic()
    reference = attempt([*base, "--dir", str(workdir / "reference")], workdir / "reference.log", None, None)
    if reference.final is None:
        raise SystemExit(f"the uninterrupted reference run failed; see {workdir / 'reference.log'}")
    results = Results(interval=every, steps_per_run=reference.last_step, memory=memory)
    compute_span = reference.seconds  # a random instant anywhere in a run's lifetime
    index, deck = 0, []
    while results.kills < kills:
        one_run(workdir, index, base, reference, results, rng, deck, kills_per_run, compute_span)
        index += 1
        print(f"run {index}: {results.kills} kills so far, {len(results.problems)} problems", file=sys.stderr)
    results.seconds = time.monotonic() - started
    return results


def table(doc: dict[str, Any]) -> str:
    """The results as a Markdown table (the part of docs/reliability.md this script rewrites)."""
    phases = ", ".join(f"{k} {v}" for k, v in doc["kills_by_phase"].items())
    rows = [
        ("SIGKILLs", f"{doc['kills']} ({phases})", "≥ 200"),
        (
            "restarts that resumed",
            f"{doc['restores_from_checkpoint']} from a checkpoint + "
            f"{doc['fresh_starts_after_kill']} from scratch (killed before the first commit); "
            f"{doc['kills_during_startup']} of the restarts were themselves killed while cleaning up",
            "all",
        ),
        ("unrestorable states", str(doc["unrestorable"]), "0"),
        (
            "broken checkpoints visible after a kill",
            f"{doc['visible_checkpoints_corrupt']} of "
            f"{doc['visible_checkpoints_verified'] + doc['visible_checkpoints_corrupt']} read back",
            "0",
        ),
        ("runs bit-identical to the uninterrupted run", f"{doc['runs_bit_identical']} of {doc['runs']}", "all"),
        ("hung processes", str(doc["hangs"]), "0"),
        (
            "work lost per kill (optimizer steps)",
            f"max {doc['max_lost_steps']}, mean {doc['mean_lost_steps']:.1f}",
            f"≤ {doc['lost_bound_steps']} (one interval + one checkpoint in flight)",
        ),
        (
            "campaign",
            f"{doc['runs']} runs of {doc['steps_per_run']} steps, checkpoint every "
            f"{doc['interval']} steps, {doc['seconds']:.0f} s",
            "",
        ),
    ]
    if doc["memory"]:
        rows[-1:-1] = [
            (
                "restarts that restored the newest complete state of any tier",
                f"{doc['restarts'] - doc['restores_not_newest']} of {doc['restarts']} "
                f"({doc['restores_from_memory']} from the memory tier)",
                "all",
            ),
        ]
        rows[-1] = (rows[-1][0], rows[-1][1] + f", memory snapshot every {doc['memory']} step(s)", "")
    lines = ["| measure | result | goal |", "| --- | --- | --- |"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def write_report(doc: dict[str, Any], path: Path, command: str) -> None:
    """Replace the table between the chaos markers in ``path`` (the memory tier's own markers with ``--memory``)."""
    marker = "chaos-memory" if doc["memory"] else "chaos"
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    text = path.read_text() if path.exists() else f"{begin}\n{end}\n"
    if begin not in text or end not in text:
        text += f"\n{begin}\n{end}\n"
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    stamp = time.strftime("%Y-%m-%d", time.gmtime())
    body = f"Measured {stamp} with `{command}` (torch {torch.__version__}).\n\n{table(doc)}\n"
    path.write_text(f"{head}{begin}\n{body}{end}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=200, help="stop after this many SIGKILLs")
    parser.add_argument("--kills-per-run", type=int, default=8)
    parser.add_argument("--every", type=int, default=4, help="checkpoint interval in steps")
    parser.add_argument("--epochs", type=int, default=12, help="8 steps each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory", type=int, default=0, help="memory-tier cadence in steps (0: off)")
    parser.add_argument("--workdir", type=Path, help="keep the run directories here (default: a temporary one)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--report", type=Path, default=REPORT, help="Markdown file whose results table is rewritten")
    parser.add_argument("--no-report", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="checkfreq-chaos-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        results = campaign(args.kills, args.kills_per_run, args.seed, workdir, args.every, args.epochs, args.memory)
    doc = results.summary()
    print(table(doc))
    for problem in results.problems:
        print("problem:", problem, file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    if not args.no_report:
        command = " ".join(["python benchmarks/chaos.py", *(argv if argv is not None else sys.argv[1:])])
        write_report(doc, args.report, command)
    ok = not (
        results.unrestorable
        or results.visible_checkpoints_corrupt
        or results.runs_different
        or results.hangs
        or results.runs_failed
        or results.max_lost > 2 * results.interval
        or results.restores_not_newest
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
