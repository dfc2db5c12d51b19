"""The report of ``benchmarks/protocol_sim.py``: per N and phase each count for rank 0 and the
median and maximum over the other ranks (:func:`rows`), the numbers the acceptance criteria read
(:func:`summary`), the copies' table (:func:`replica_table`) and a verdict per criterion."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.replica_sim import RANKS_PER_MACHINE
from benchmarks.sim_results import Run

PHASES = ("startup", "memory group", "commit", "snapshot copy", "vote", "fetch round", "restore")
COPY_PHASE = "snapshot copy"
"""Counted from real copies (``benchmarks/replica_sim.py``), not run on the ranks' threads: no CPU or file counts."""


def _spread(values: Sequence[float]) -> tuple[float, float]:
    """(median, maximum) of ``values`` (0 for none)."""
    return (statistics.median(values), max(values)) if values else (0.0, 0.0)


def rows(run: Run) -> list[dict[str, Any]]:
    """One row per (phase, count): rank 0's value, and the median and maximum over the other ranks."""
    out = []
    for phase in PHASES:
        counts = run.counts(phase)
        if phase == "restore" and not run.restored or phase == COPY_PHASE and not run.copies_kept:
            continue
        metrics = {
            "messages in": lambda c, r: c.messages_in,
            "messages out": lambda c, r: c.messages_out,
            "bytes in": lambda c, r: c.bytes_in,
            "bytes out": lambda c, r: c.bytes_out,
            "CPU ms": lambda c, r: 1000 * c.cpu_s,
            "store operations": lambda c, r: c.store_ops,
            "of which polls": lambda c, r: c.store_polls,
            "connections": lambda c, r: c.connections(r, run.world),
            "files read": lambda c, r: len(c.files_read),
            "files looked up": lambda c, r: c.lookups,
        }
        if phase == COPY_PHASE:
            metrics = {k: m for k, m in metrics.items() if k not in ("CPU ms", "files read", "files looked up")}
        for name, metric in metrics.items():
            others = [metric(c, r) for r, c in enumerate(counts) if r]
            median, most = _spread(others)
            out.append(
                {
                    "world": run.world,
                    "phase": phase,
                    "count": name,
                    "rank0": metric(counts[0], 0),
                    "median": median,
                    "max": most,
                }
            )
    return out


def summary(run: Run) -> dict[str, Any]:
    """The numbers the acceptance criteria read, for one world."""
    commit, startup = run.counts("commit"), run.counts("startup")
    others = range(1, run.world)
    total = sum(run.file_bytes)
    return {
        "world": run.world,
        "wall_s": round(run.wall_s, 2),
        "threads_s": round(run.threads_s, 2),
        **{f"{phase}_wall_s": round(run.counts(phase)[0].wall_s, 2) for phase in PHASES},
        "commit_bytes_max": max(commit[r].bytes_in + commit[r].bytes_out for r in others),
        "commit_cpu_ms_median": 1000 * statistics.median(commit[r].cpu_s for r in others),
        "commit_cpu_ms_max": 1000 * max(commit[r].cpu_s for r in others),
        "rank0_commit_cpu_s": commit[0].cpu_s,
        "startup_store_ops_max": max(startup[r].store_ops - startup[r].store_polls for r in others),
        "manifest_bytes": run.manifest_bytes,
        "manifest_parse_ms": 1000 * run.manifest_parse_s,
        "restore_plan_ms": 1000 * run.plan_cpu_s,
        "restore_readers": sorted({len(ranks) for ranks in run.readers.values()}),
        "restore_each_reads_its_own": all(
            ranks == [int(name[len("rank") :].split(".")[0])] for name, ranks in run.readers.items()
        ),
        "restore_files_per_rank": max(sum(1 for ranks in run.readers.values() if r in ranks) for r in range(run.world)),
        "restore_stream_ms": 1000 * run.stream_cpu_s,
        "restore_bytes_in_max": max(c.bytes_in for c in run.counts("restore")) if run.restored else None,
        "restore_bytes_in_planned": run.stream_bytes,
        "restore_bytes_in_whole_files": total - min(run.file_bytes),  # every file but its own, as before
        **_replica_summary(run),
    }


def _replica_summary(run: Run) -> dict[str, Any]:
    """The copies' numbers: each snapshot's per rank (the most of any rank), and the fetch round's."""
    copy, fetch = run.counts(COPY_PHASE), run.counts("fetch round")
    others = range(1, run.world)
    return {
        "replicas": run.replicas,
        "copies_kept": run.copies_kept,
        "slot_bytes": run.slot_bytes,
        "copy_sent_bytes": run.copy_sent_bytes,
        "copy_messages_max": max(c.messages_in + c.messages_out for c in copy),
        "copy_bytes_max": max(c.bytes_in + c.bytes_out for c in copy),
        "copy_store_ops_max": max(c.store_ops for c in copy),
        "copy_connections_max": max(c.connections(r, run.world) for r, c in enumerate(copy)),
        "fetch_report_bytes_max": max(run.report_bytes),
        "fetch_gather_bytes": sum(run.report_bytes[1:]),
        "fetch_plan_bytes": run.fetch_plan_bytes,
        "fetch_plan_ms": 1000 * run.fetch_plan_s,
        "fetch_decode_ms": 1000 * run.fetch_decode_s,
        "fetch_rank0_cpu_ms": 1000 * fetch[0].cpu_s,
        "fetch_messages_max": max(fetch[r].messages_in + fetch[r].messages_out for r in others),
        "fetch_bytes_max": max(fetch[r].bytes_in + fetch[r].bytes_out for r in others),
        "fetch_connections_max": max(fetch[r].connections(r, run.world) for r in others),
        "fetched": sorted({str(o.fetched) for o in run.outcomes}),
        "adopted": sum(o.adopted for o in run.outcomes),
    }


REPLICA_COLUMNS = {
    "slot_bytes": "slot B",
    "copy_sent_bytes": "copy B (to each keeper)",
    "copy_messages_max": "copy: messages per rank",
    "copy_bytes_max": "copy: bytes per rank",
    "copy_store_ops_max": "copy: store operations",
    "copy_connections_max": "copy: connections",
    "fetch_report_bytes_max": "fetch: report B",
    "fetch_gather_bytes": "fetch: rank 0 gathers B",
    "fetch_plan_bytes": "fetch: plan B",
    "fetch_plan_ms": "fetch_plan ms",
    "fetch_decode_ms": "decode ms",
    "fetch_rank0_cpu_ms": "fetch: rank 0 CPU ms",
    "fetch_messages_max": "fetch: messages per rank",
    "fetch_connections_max": "fetch: connections",
}
"""The replicas table's columns (:func:`replica_table`): each a key of :func:`summary`."""


def replica_table(sums: Sequence[dict[str, Any]]) -> list[str]:
    """The copies' figures, one row per N: per rank the most of any rank (in + out), for one
    snapshot's copy and for the fetch round after a machine's loss; rank 0's gather and plan."""
    lines = ["| N | " + " | ".join(REPLICA_COLUMNS.values()) + " |", "| --- " * (len(REPLICA_COLUMNS) + 1) + "|"]
    for s in sums:
        lines.append(f"| {s['world']:,} | " + " | ".join(figure(s[k]) for k in REPLICA_COLUMNS) + " |")
    return lines


def verdicts(sums: list[dict[str, Any]], fsdp2: dict[int, int], layers: int) -> list[tuple[str, bool, str]]:
    """Each acceptance criterion: its name, whether the numbers meet it, and the numbers."""
    small, large = sums[0], sums[-1]
    per_rank_bytes = large["commit_bytes_max"] <= 2 * small["commit_bytes_max"]
    per_rank_cpu = large["commit_cpu_ms_median"] <= 2 * small["commit_cpu_ms_median"]
    ops = {s["startup_store_ops_max"] for s in sums}
    largest = max(s["world"] for s in sums)
    manifests = max(large["manifest_bytes"], fsdp2[largest])
    n0, n1 = f"N = {small['world']:,}", f"N = {large['world']:,}"
    copied = [s for s in sums if s["copies_kept"]] or [small]  # the worlds of more than one machine
    c0, c1 = copied[0], copied[-1]
    return [
        (
            "a rank's bytes per checkpoint within 2x",
            per_rank_bytes,
            f"most of a rank other than 0 (in + out): {small['commit_bytes_max']:,} B at {n0}, "
            f"{large['commit_bytes_max']:,} B at {n1}",
        ),
        (
            "a rank's CPU per checkpoint within 2x",
            per_rank_cpu,
            f"median of the ranks other than 0: {small['commit_cpu_ms_median']:.2f} ms at {n0}, "
            f"{large['commit_cpu_ms_median']:.2f} ms at {n1}",
        ),
        (
            "rank 0's commit work <= 1 s",
            large["rank0_commit_cpu_s"] <= 1.0,
            f"rank 0's CPU in Committer.run at {n1}: {large['rank0_commit_cpu_s']:.3f} s",
        ),
        (
            "start-up store operations per rank constant",
            len(ops) == 1,
            f"a rank other than 0, polls left out: {sorted(ops)} at every N",
        ),
        (
            "manifest <= 16 MB (DDP and FSDP2)",
            manifests <= 16_000_000,
            f"{8 * layers} tensors at N = {largest:,}: DDP {large['manifest_bytes']:,} B, FSDP2 {fsdp2[largest]:,} B",
        ),
        (
            "a rank's copy per snapshot flat (messages; bytes within 1%; <= 2k connections; no store operation)",
            flat_copies(copied),
            f"the most of any rank (in + out): {c0['copy_messages_max']} messages, {c0['copy_bytes_max']:,} B, "
            f"{c0['copy_connections_max']} connections at N = {c0['world']:,}; {c1['copy_messages_max']}, "
            f"{c1['copy_bytes_max']:,} B, {c1['copy_connections_max']} at N = {c1['world']:,}; store operations: "
            f"{max(s['copy_store_ops_max'] for s in sums)}",
        ),
        (
            "rank 0's fetch_plan <= 1 s",
            large["fetch_plan_ms"] <= 1000,
            f"one machine of {RANKS_PER_MACHINE} lost, at {n1}: {large['fetch_plan_ms']:.1f} ms (decoding the reports: "
            f"{large['fetch_decode_ms']:.1f} ms)",
        ),
    ]


def flat_copies(sums: Sequence[dict[str, Any]]) -> bool:
    """Whether a rank's copy of a snapshot costs the same at every size of ``sums``: the same
    messages, bytes within 1% (the digits of rank numbers in its manifest), at most its k keepers and
    k senders (fewer where two machines copy to each other), no store operation; False without copies."""
    first = sums[0]
    return all(
        s["copies_kept"]
        and s["copy_messages_max"] == first["copy_messages_max"]
        and s["copy_store_ops_max"] == 0
        and s["copy_connections_max"] <= 2 * s["replicas"]
        and abs(s["copy_bytes_max"] - first["copy_bytes_max"]) <= first["copy_bytes_max"] / 100
        for s in sums
    )


def figure(value: float) -> str:
    """A count as the tables print it: thousands separated, two decimals unless whole."""
    return f"{value:,.2f}" if isinstance(value, float) and not value.is_integer() else f"{int(value):,}"
