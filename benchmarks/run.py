"""Run the benchmark suite and write ``performance.md`` (tables), ``performance.png`` and ``performance.json``.

    python -m benchmarks.run                    # 100 MB, 500 MB, 2 GB states + the training loop
    python -m benchmarks.run --sizes 500 --no-train
    python -m benchmarks.run --quick --out /tmp/x   # a few MB, seconds (the smoke test)
    python -m benchmarks.run --cuda             # adds the GPU mode (skips without CUDA)
    python -m benchmarks.run --out docs         # rewrites docs/performance.* (the published figures)

Without ``--out`` the files go to a new temporary directory, printed at the start and the end:
a trial run never changes the checkout.

Each state size, the memory measurement, the training loop and the GPU mode run in their own
fresh process (the orchestrator re-executes itself with ``--worker``), all with the same malloc
environment, so freed memory of one measurement never flatters the next.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

# glibc returning memory to the OS and mapping large blocks afresh costs page faults on every
# allocation on these machines (see docs/performance.md); every variant runs with the same setting.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "68719476736"}
ROOT = Path(__file__).resolve().parent.parent

log = logging.getLogger("benchmarks")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="100,500,2000", help="state sizes in MB, comma-separated")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 5, quick 2)")
    p.add_argument("--quick", action="store_true", help="tiny states and loop (seconds); for the smoke test")
    p.add_argument("--no-train", action="store_true", help="skip the training loop")
    p.add_argument("--train-steps", type=int, default=None, help="steps per training run")
    p.add_argument("--train-repeats", type=int, default=3, help="interleaved rounds of the training loop")
    p.add_argument("--intervals", default="1,10,100", help="checkpoint intervals of the training loop")
    p.add_argument("--cuda", action="store_true", help="add the GPU mode (skipped cleanly without CUDA)")
    p.add_argument("--gpu-size", type=float, default=4000, help="GPU state size in MB")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: torch's; quick: 1)")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where performance.md/.png/.json go (default: a new temporary directory; "
        "--out docs updates the published page)",
    )
    p.add_argument("--worker", choices=["state", "memory", "train", "gpu"], help=argparse.SUPPRESS)
    p.add_argument("--size", type=float, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 2 if args.quick else 5
    if args.quick and args.sizes == "100,500,2000":
        args.sizes = "2"
    if args.quick and args.threads is None:
        args.threads = 1
    return args


def run_worker(args: argparse.Namespace) -> Any:
    """The measurement itself, in this (fresh) process."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker == "state":
        from benchmarks.state_bench import bench_state

        return bench_state(args.size, args.repeats, args.quick)
    if args.worker == "memory":
        from benchmarks.memory import bench_memory

        return bench_memory(args.size)
    if args.worker == "train":
        from benchmarks.training import FULL, QUICK, Workload, bench_training

        base = QUICK if args.quick else FULL
        workload = Workload(base.widths, base.batch, args.train_steps or base.steps)
        intervals = tuple(int(n) for n in args.intervals.split(","))
        return bench_training(workload, args.train_repeats if not args.quick else 2, intervals)
    from benchmarks.gpu_state import bench_gpu

    return bench_gpu(args.size, args.repeats)


def spawn(args: argparse.Namespace, worker: str, tmp: Path, size: float | None = None) -> Any:
    """Run one worker in a fresh process with the suite's environment; its JSON result."""
    result = tmp / f"{worker}-{size}.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.run",
        "--worker",
        worker,
        "--result",
        str(result),
        "--repeats",
        str(args.repeats),
        "--intervals",
        args.intervals,
        "--train-repeats",
        str(args.train_repeats),
    ]
    if size is not None:
        cmd += ["--size", str(size)]
    if args.quick:
        cmd.append("--quick")
    if args.train_steps:
        cmd += ["--train-steps", str(args.train_steps)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    env = {
        **os.environ,
        **MALLOC_ENV,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    log.info("running %s%s", worker, f" ({size:g} MB)" if size is not None else "")
    done = subprocess.run(cmd, env=env, cwd=ROOT)
    if done.returncode:
        log.error("%s worker failed with exit status %d", worker, done.returncode)
        return None
    return json.loads(result.read_text())


def environment() -> str:
    return (
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} torch threads, "
        f"Python {platform.python_version()}, {platform.machine()}, malloc env {MALLOC_ENV}"
    )


def bench_size(args: argparse.Namespace, size: float, tmp: Path, results: dict[str, Any]) -> None:
    """The state and memory workers of one size; a failed worker leaves its entry out (and is logged)."""
    for worker, key in (("state", "states"), ("memory", "memory")):
        result = spawn(args, worker, tmp, size)
        if result is not None:
            results[key][f"{size:g}"] = result
        else:
            results.setdefault("failed", []).append(f"{worker} worker, {size:g} MB")


def orchestrate(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [float(s) for s in args.sizes.split(",") if s]
    results: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "environment": environment(),
        "states": {},
        "memory": {},
    }
    with tempfile.TemporaryDirectory(prefix="cf-bench-run-") as tmp:
        small, large = [s for s in sizes if s < 1000], [s for s in sizes if s >= 1000]
        for size in small:
            bench_size(args, size, Path(tmp), results)
        if not args.no_train:  # before the large states: a large state can exhaust a shared machine
            results["training"] = spawn(args, "train", Path(tmp))
        for size in large:
            bench_size(args, size, Path(tmp), results)
        if args.cuda and not torch.cuda.is_available():
            results["gpu"] = {"skipped": "no CUDA device in this environment"}
        elif args.cuda:
            results["gpu"] = spawn(args, "gpu", Path(tmp), 64 if args.quick else args.gpu_size)
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.worker:
        args.result.write_text(json.dumps(run_worker(args), allow_nan=True))
        return
    from benchmarks.report import plot, render, splice

    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="checkfreq-bench-"))
    log.info("results go to %s", args.out)
    results = orchestrate(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "performance.json").write_text(json.dumps(results, allow_nan=True))
    png = args.out / "performance.png"
    plot(results, png)
    section = render(results, png.name if png.exists() else None)
    splice(args.out / "performance.md", section)
    print(section)
    print(f"\nwritten into {args.out}: performance.md, performance.png, performance.json")


if __name__ == "__main__":
    main()
