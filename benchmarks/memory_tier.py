"""The memory tier's costs and gains, measured in one process:

* the whole-run overhead of memory snapshots on the training-loop benchmark (a snapshot into
  shared memory every step and no persist; the default cadence with the default policy; the
  default policy alone), each run between two runs without checkpoints, as ratios of wall time;
* ``restore()`` from the memory tier against ``restore()`` from disk with a cold and a hot page
  cache, for states of 500 MB and 2 GB.

    python -m benchmarks.memory_tier                       # prints a Markdown table
    python -m benchmarks.memory_tier --json out.json --sizes 500 --steps 60 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import checkfreq as cf
from benchmarks.limits import drop_cache, warm_cache
from benchmarks.states import build_state
from benchmarks.training import FULL, CheckfreqSaver, NoSave, Saver, Workload, train

NEVER = cf.Every(n=10**12)
VARIANTS = {
    "memory snapshot every step, no persist": lambda: CheckfreqSaver(NEVER, memory=1),
    "memory=True with the default policy": lambda: CheckfreqSaver("auto", memory=True),
    "default policy, no memory tier": lambda: CheckfreqSaver("auto"),
}


def wall(saver: Saver, workload: Workload, workdir: Path) -> float:
    run = train(workload, workload.steps, saver, workdir)
    return run.spans[-1][1] - run.spans[0][0]


def bench_loop(workload: Workload, rounds: int) -> dict[str, Any]:
    """Ratio of each variant's wall time to the mean of the no-checkpoint runs just before and after it."""
    ratios: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="cf-memory-") as tmp:
        root = Path(tmp)
        wall(NoSave(), Workload(workload.widths, workload.batch, max(workload.steps // 4, 2)), root)  # warm-up
        seq = 0

        def run(saver: Saver) -> float:
            nonlocal seq
            seq += 1
            (root / str(seq)).mkdir()
            return wall(saver, workload, root / str(seq))

        before = run(NoSave())
        for round_ in range(rounds):
            names = list(VARIANTS)[round_ % len(VARIANTS) :] + list(VARIANTS)[: round_ % len(VARIANTS)]
            for name in names:
                seconds = run(VARIANTS[name]())
                after = run(NoSave())
                ratios[name].append(seconds / ((before + after) / 2))
                before = after
    return {"steps": workload.steps, "ratios": ratios}


def bench_restore(megabytes: float, repeats: int) -> dict[str, list[float]]:
    """Seconds of ``restore()`` from memory, from disk with a cold and with a hot page cache."""
    state = build_state(megabytes)
    times: dict[str, list[float]] = {"memory": [], "disk, cold cache": [], "disk, hot cache": []}
    with tempfile.TemporaryDirectory(prefix="cf-memory-") as tmp:
        with cf.Checkpointer(
            Path(tmp) / "run", policy=NEVER, memory=1, model=state.model, optimizer=state.optimizer
        ) as ckpt:
            state.optimizer.step()  # no gradients: changes nothing; step() follows an optimizer step, as in training
            ckpt.step()
            ckpt.save(blocking=True)  # step 1 on disk (and in memory)
            files = list(ckpt.directory.glob("step_*/*.safetensors"))
            for _ in range(repeats):
                # no gradients: changes nothing; step() follows an optimizer step, as in training
                state.optimizer.step()
                ckpt.step()
                ckpt.step()  # memory holds the two newest steps, neither of them step 1
                ckpt.wait()
                start = time.perf_counter()
                ckpt.restore()
                times["memory"].append(time.perf_counter() - start)
                for cold in (True, False):
                    for path in files:
                        (drop_cache if cold else warm_cache)(path)
                    start = time.perf_counter()
                    ckpt.restore(step=1)
                    times[f"disk, {'cold' if cold else 'hot'} cache"].append(time.perf_counter() - start)
    return {"nbytes": state.nbytes, **times}


def table(doc: dict[str, Any]) -> str:
    lines = ["| measure | result |", "| --- | --- |"]
    for name, values in doc["loop"]["ratios"].items():
        lines.append(
            f"| training loop, {name}: wall time / no checkpoints | "
            f"{statistics.median(values):.3f} (runs: {', '.join(f'{v:.3f}' for v in values)}) |"
        )
    for size, result in doc["restore"].items():
        memory = statistics.median(result["memory"])
        for name in ("memory", "disk, cold cache", "disk, hot cache"):
            median = statistics.median(result[name])
            lines.append(
                f"| restore {size} MB state ({result['nbytes'] / 1e6:.0f} MB), {name} | "
                f"{median:.3f} s ({median / memory:.1f}× memory) |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="500,2000", help="state sizes in MB for the restore measurement")
    parser.add_argument("--steps", type=int, default=FULL.steps)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    doc = {
        "torch": torch.__version__,
        "loop": bench_loop(Workload(FULL.widths, FULL.batch, args.steps), args.rounds),
        "restore": {size: bench_restore(float(size), args.repeats) for size in args.sizes.split(",")},
    }
    print(table(doc))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
