"""The training thread's cost of checkfreq between checkpoints: ``ckpt.step()`` when the policy says no,
and a training forward of a registered module (the consistent point's hook), each beside its baseline.

    python -m benchmarks.step_cost [--calls 20000] [--repeats 7]

Variants run interleaved, ``repeats`` rounds of ``calls`` calls each; it prints each variant's median
time per call over the rounds, its spread (min-max of the rounds) and, for the forward, the ratio to a
forward of an unregistered module of the same shape measured in the same rounds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

import checkfreq as cf
from checkfreq.data import ResumableLoader


def _per_call(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def measure(calls: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each variant, one sample per round."""
    torch.manual_seed(0)
    registered, plain = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
    optimizer = torch.optim.SGD(registered.parameters(), lr=0.1)
    loader = ResumableLoader(torch.utils.data.TensorDataset(torch.randn(64, 16)), batch_size=8)
    x = torch.randn(4, 16)
    samples: dict[str, list[float]] = {"step()": [], "forward, registered": [], "forward, plain": []}
    with (
        tempfile.TemporaryDirectory() as directory,
        cf.Checkpointer(
            directory, policy=cf.Every(10**9), model=registered, optimizer=optimizer, loader=loader
        ) as ckpt,
    ):
        registered(x).sum().backward()
        optimizer.step()
        ckpt.step()  # the session's first step, after an optimizer step
        variants = {
            "step()": ckpt.step,
            "forward, registered": lambda: registered(x),
            "forward, plain": lambda: plain(x),
        }
        for fn in variants.values():
            _per_call(fn, calls // 10)  # warm up
        for round_ in range(repeats):
            names = list(variants)
            names = names[round_ % len(names) :] + names[: round_ % len(names)]  # rotate the order
            for name in names:
                samples[name].append(_per_call(variants[name], calls))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    samples = measure(args.calls, args.repeats)
    plain = statistics.median(samples["forward, plain"])
    for name, values in samples.items():
        median = statistics.median(values)
        ratio = f"  {median / plain:.2f}x the plain forward" if name.startswith("forward") else ""
        print(
            f"{name:22s} {median * 1e6:8.2f} µs per call (rounds {min(values) * 1e6:.2f}-{max(values) * 1e6:.2f})"
            f"{ratio}"
        )


if __name__ == "__main__":
    main()
