"""How far the copies of memory snapshots on another machine (``replicas=``) lag the snapshots when
copying is slower than snapshotting, and whether a step every rank can restore from memory always exists.

    python -m benchmarks.copy_lag [--interval 0.1] [--ratios 0.5 1.5 3] [--snapshots 30] [--megabytes 16]

One sender and its keeper, as ``benchmarks/replica_sim.py`` runs them: real
:class:`~checkfreq.pipeline.tiers.memory.replicas.ReplicaLink` threads, real shared-memory regions and the
keeper's checksum check, over :class:`Throttled`, the simulator's in-memory wire with a bandwidth. The
sender takes a snapshot every ``interval`` seconds of training; each copy takes ``ratio`` intervals
(the bandwidth is set so). Two rules are compared, interleaved:

* **consistent cut** (what the memory tier does, docs/storage.md, "Copies that lag"): a snapshot is begun
  only once the previous one's copy is kept (:meth:`ReplicaLink.catch_up`), in a region of
  :data:`~checkfreq.storage.shm.COPIED_SLOTS` slots whose two newest snapshots are never overwritten;
* **skip in flight** (the rule before it): a snapshot is copied only if no copy is in flight, into two slots.

At each snapshot's begin, the worst moment (a slot just invalidated), it records the newest step that both
the sender's own region and the keeper's copies hold whole: where the sender's machine, lost then,
resumes from memory (its peers hold their own snapshots on the same cadence as the sender). It prints per
ratio and rule: the snapshots taken, the interval they came at, the waits for a copy, the copy lag
(snapshots begun since the newest copy kept) and the moments with no such step, every figure from the same run.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.replica_sim import Wire, WireGroup, _on_wire, slot
from benchmarks.report import print_rows
from checkfreq.pipeline.tiers.memory.replicas import ReplicaLink
from checkfreq.storage.shm import COPIED_SLOTS, SLOTS, MemoryRegion, layout_signature
from checkfreq.storage.shm_paths import device_and_inode, replica_path

RULES = ("consistent cut", "skip in flight")
SENDER, KEEPER = 8, 0
"""The sender's rank (on the second machine of 8 ranks) and its keeper's (on the first)."""


class Throttled(Wire):
    """The simulator's wire, each message taking its bytes over ``bandwidth`` bytes a second to send."""

    def __init__(self, bandwidth: float) -> None:
        super().__init__()
        self.bandwidth = bandwidth

    def send(self, tensor: torch.Tensor, *, group: WireGroup, group_dst: int, tag: int = 0) -> None:
        time.sleep(tensor.numel() * tensor.element_size() / self.bandwidth)
        super().send(tensor, group=group, group_dst=group_dst, tag=tag)


@dataclass
class Row:
    """One ratio and rule."""

    ratio: float
    rule: str
    copy_bytes: int
    snapshots: int
    interval_s: float
    """Median time between two snapshots' begins."""
    waits: int
    wait_s: float
    """Median wait for the previous copy (0 without waits)."""
    copies_kept: int
    lag_median: float
    lag_max: int
    """Snapshots begun since the newest copy kept, at each begin."""
    behind_max: int | None
    """The most snapshots between the newest begun and the newest step both sides hold (None: at some
    moment no step was held by both)."""
    without_cut: int
    """Begins at which no step was held whole by both the sender's region and the keeper's copies."""


def run(rule: str, ratio: float, interval: float, snapshots: int, megabytes: float) -> Row:
    """``snapshots`` snapshots of about ``megabytes`` MB every ``interval`` s, each copy taking ``ratio`` intervals."""
    data_bytes, meta = slot(16, SENDER, 8, layers=2, own_bytes=int(megabytes * 1e6))
    wire = Throttled(data_bytes / (ratio * interval))
    cut_rule = rule == RULES[0]
    with tempfile.TemporaryDirectory(prefix="checkfreq-copy-lag-") as tmp, _on_wire(wire, Path(tmp)):
        ckpt = Path(tmp) / "ckpt"
        ckpt.mkdir()
        keeper = ReplicaLink(WireGroup(wire, KEEPER), ckpt, sends_to=None, receives_from=[SENDER])
        sender = ReplicaLink(WireGroup(wire, SENDER), ckpt, sends_to=[KEEPER], receives_from=[])
        own = MemoryRegion(Path(tmp) / "own", device_and_inode(ckpt), slots=COPIED_SLOTS if cut_rule else SLOTS)
        own.reserve(data_bytes, len(meta))
        begins, waits, lags, behind, without = [], [], [], [], 0
        try:
            start = time.perf_counter()
            for step in range(1, snapshots + 1):
                time.sleep(max(0.0, start + step * interval - time.perf_counter()))  # the training between
                if cut_rule and (waited := sender.catch_up(step, 600.0)):
                    waits.append(waited)
                opened = own.begin(keep=sender.sending)
                begins.append(time.perf_counter())
                held = {info.step for info in own.snapshots()}
                kept = _kept_steps(ckpt)
                lags.append(step - max(kept, default=0))
                common = held & kept
                if common:
                    behind.append(step - max(common))
                else:
                    without += step > 2  # the first two have nothing to be held yet
                info = own.commit(opened, step, data_bytes, meta, layout_signature("lag"))
                sender.offer(own, info)
            sender.wait_sent(600.0)
        finally:
            sender.close(60.0)
            keeper.close(60.0)
            own.release(remove=True)
    gaps = [b - a for a, b in zip(begins, begins[1:], strict=False)]
    return Row(
        ratio=ratio,
        rule=rule,
        copy_bytes=sender.sent[0].nbytes if sender.sent else 0,
        snapshots=snapshots,
        interval_s=statistics.median(gaps),
        waits=len(waits),
        wait_s=statistics.median(waits) if waits else 0.0,
        copies_kept=len(sender.sent),
        lag_median=statistics.median(lags[2:]),
        lag_max=max(lags[2:]),
        behind_max=max(behind) if without == 0 and behind else None,
        without_cut=without,
    )


def _kept_steps(ckpt: Path) -> set[int]:
    """The steps of the sender's copies the keeper holds whole (as a restore would list them)."""
    copies = MemoryRegion(replica_path(ckpt, SENDER), device_and_inode(ckpt), tidy=False)
    try:
        return {info.step for info in copies.snapshots()}
    finally:
        copies.release(remove=False)


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| copy / interval | rule | copy B | snapshots | interval | waits (median) | copies kept | copy lag: "
        "median, max | newest common step behind, at most | begins with no common step |",
        "| ---: | --- | ---: | ---: | ---: | --- | ---: | --- | ---: | ---: |",
    ]
    for r in rows:
        behind = "—" if r.behind_max is None else f"{r.behind_max} snapshots"
        lines.append(
            f"| {r.ratio:g} | {r.rule} | {r.copy_bytes:,} | {r.snapshots} | {r.interval_s * 1e3:.0f} ms | "
            f"{r.waits} ({r.wait_s * 1e3:.0f} ms) | {r.copies_kept} | {r.lag_median:g}, {r.lag_max} | {behind} | "
            f"{r.without_cut} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=0.1, help="seconds of training between snapshots")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 1.5, 3.0], help="copy time / interval")
    parser.add_argument("--snapshots", type=int, default=30)
    parser.add_argument("--megabytes", type=float, default=16.0, help="each snapshot's state of the rank's own")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    logging.getLogger("checkfreq").setLevel(logging.ERROR)  # each wait and skip is the table's, not a warning's
    rows = [run(rule, ratio, args.interval, args.snapshots, args.megabytes) for ratio in args.ratios for rule in RULES]
    print_rows(table(rows), rows, args.json)


if __name__ == "__main__":
    main()
