"""The protocol simulator (benchmarks/protocol_sim.py): checkfreq's real start-up, commit and restore
code on a thread per rank over an in-memory transport, at a few ranks, and what its counts show."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT

sys.path.insert(0, str(ROOT))

from benchmarks.protocol_sim import COPY_PHASE, RANKS_PER_MACHINE, Baton, Run, main, simulate  # noqa: E402
from benchmarks.replica_sim import LinkCounts, Loss, copy_counts, measured_senders, per_snapshot, sent, slot  # noqa: E402
from benchmarks.scale_costs import PRIVATE_TENSORS  # noqa: E402

from checkfreq.pipeline.restore.plan import fetch_plan  # noqa: E402
from checkfreq.ranks.collectives import TREE_ARITY  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Run]:
    return {
        world: simulate(world, layers=10, directory=str(tmp_path_factory.mktemp(f"sim{world}"))) for world in (8, 64)
    }


def test_every_rank_ran_the_protocol_to_the_same_end(runs: dict[int, Run]) -> None:
    """Every rank agreed on rank 0's token and directory, committed the same step, and restored it
    with every rank's file; each rank read one file from storage, its own, and received the rest.
    Only the directory's leader (rank 0) looked up which files the directory holds."""
    for world, run in runs.items():
        first = run.outcomes[0]
        assert first.restored == "step_000000100" and first.restored_files == world
        for rank, outcome in enumerate(run.outcomes):
            assert (outcome.token, outcome.directory, outcome.commit.step) == (first.token, 0, 100), rank
            assert (outcome.restored, outcome.restored_files) == (first.restored, world), rank
            assert run.ledgers[rank].phases["restore"].files_read == [f"rank{rank:05d}.safetensors"]
            assert run.ledgers[rank].phases["restore"].lookups == (world if rank == 0 else 0)
        assert run.readers == {f"rank{r:05d}.safetensors": [r] for r in range(world)}


def test_fsdp2_ranks_each_read_their_own_file_and_receive_no_other(tmp_path: Path) -> None:
    """FSDP2 at 16 ranks (rows of 32 over 16 ranks: 2 each): each rank reads its own file, which
    holds its blocks, and receives rank 0's orders and AdamW's step counts (rank 0: every rank's
    summary), no other file."""
    run = simulate(16, layers=4, directory=str(tmp_path), state="fsdp2")
    for rank, counts in enumerate(run.counts("restore")):
        assert run.outcomes[rank].restored == "step_000000100"
        assert counts.files_read == [f"rank{rank:05d}.safetensors"], (rank, counts.files_read)
        assert counts.bytes_in < (300 * 16 if rank == 0 else 1000) < min(run.file_bytes), (rank, counts.bytes_in)


def test_a_rank_other_than_0_costs_the_same_at_8_and_64_ranks(runs: dict[int, Run]) -> None:
    """Per checkpoint: the same messages, the same bytes (but for the digits of its rank and file
    size), one connection (rank 0); at start-up, the same store operations."""
    small, large = runs[8].counts("commit"), runs[64].counts("commit")
    for counts in (small[1], small[7], large[1], large[63]):
        assert (counts.messages_out, counts.messages_in) == (small[1].messages_out, small[1].messages_in), counts
        assert abs(counts.bytes_out - small[1].bytes_out) <= 8 and counts.bytes_in == small[1].bytes_in, counts
        assert counts.connections(1, 8) == 1 and counts.peers == {0} and counts.all_gathers == 0
        assert counts.bytes_out < 300 and counts.bytes_in < 60
    ops = {c.store_ops - c.store_polls for run in runs.values() for c in run.counts("startup")[1:]}
    assert ops == {6}, ops  # wait_for_every_rank: 1; agree_on_token: append, wait, get, delete, add


def test_rank_0s_commit_traffic_grows_linearly(runs: dict[int, Run]) -> None:
    small, large = runs[8].counts("commit")[0], runs[64].counts("commit")[0]
    assert small.messages_in / 7 == large.messages_in / 63 == 3  # prepare, report, outcome from each rank
    assert small.connections(0, 8) == 7 and large.connections(0, 64) == 63
    assert 0.95 < (large.bytes_in / 63) / (small.bytes_in / 7) < 1.05


def test_the_report_prints_every_criterion(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(
        ["--worlds", "8,16,24", "--layers", "10", "--restore-up-to", "8", "--dir", str(tmp_path), "--own-bytes", "4096"]
    )
    out = capsys.readouterr().out
    assert "| 8 | restore | files read | 1 | 1 | 1 |" in out and "| 16 | restore |" not in out
    assert "| 16 | snapshot copy | connections | 1 | 1 | 1 |" in out and "| 8 | snapshot copy |" not in out
    assert "| 24 | snapshot copy | connections | 2 | 2 | 2 |" in out
    assert '"restore_readers": [1], "restore_each_reads_its_own": true' in out
    rows = ["| N | slot B | copy B (to each keeper) | copy: messages per rank |", "| 8 | 0 | 0 | 0 |"]
    for world in (16, 24):  # a copy carries no replicated state: less than the slot
        data, meta = slot(world, 0, RANKS_PER_MACHINE, 10, 4096)
        copy = sum(sent(world, 0, RANKS_PER_MACHINE, 10, 4096))
        assert copy < data + len(meta)
        rows.append(f"| {world} | {data + len(meta):,} | {copy:,} | 8 |")
    table = [line for line in out.splitlines() if line.startswith(tuple(rows))]
    assert len(table) == 4, out  # the replicas table: a header and one row per N (no copies on one machine)
    verdicts = [line for line in out.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(verdicts) == 7, out
    assert verdicts[0].startswith("PASS  a rank's bytes per checkpoint within 2x")
    assert verdicts[3].startswith("PASS  start-up store operations per rank constant")
    assert verdicts[4].startswith("PASS  manifest <= 16 MB")
    assert verdicts[5].startswith("PASS  a rank's copy per snapshot flat")
    assert verdicts[6].startswith("PASS  rank 0's fetch_plan <= 1 s")


def test_the_script_prints_its_report(tmp_path: Path) -> None:
    """``python benchmarks/protocol_sim.py`` runs its main (the documented command)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "protocol_sim.py"),
            "--worlds",
            "16",
            "--layers",
            "2",
            "--restore-up-to",
            "0",
            "--own-bytes",
            "4096",
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=True,
    )
    # rank 0: 1 per rank and its 8 children in tree_max; a lost rank: the plan, 4 (its copy) and its parent in
    # tree_max; rank 1: the plan, its parent and its 7 children
    assert "| 16 | fetch round | messages in | 23 | 6 | 9 |" in done.stdout, done.stdout
    assert sum(line.startswith("PASS") for line in done.stdout.splitlines()) == 7, done.stdout


def test_rank_0s_start_up_traffic_grows_linearly(runs: dict[int, Run]) -> None:
    """Rank 0 receives 4 messages from every rank (the identities, the probe barrier and check,
    opening the directories) and sends each 6 (the token, its leader's length and value, and three
    verdicts): no step of the start-up costs it more than a constant per rank."""
    for world, run in runs.items():
        counts = run.counts("startup")[0]
        assert (counts.messages_in, counts.messages_out) == (4 * (world - 1), 6 * (world - 1)), world
    small, large = runs[8].counts("startup")[0], runs[64].counts("startup")[0]
    assert 0.95 < (large.bytes_in / 63) / (small.bytes_in / 7) < 1.05


def test_a_rank_wakes_the_ranks_it_delivered_to_when_it_passes_the_baton() -> None:
    """While a rank computes no other rank thread is woken: what its messages would wake waits
    until it waits itself (or ends), and the CPU it then spends waking them is not its own."""
    baton, woken = Baton(), []
    with baton.held():
        baton.wake(lambda: woken.append("message"))
        assert woken == []
        with baton.passed():
            assert woken == ["message"]
        baton.wake(lambda: woken.append("store key"))
    assert woken == ["message", "store key"]
    baton.wake(lambda: woken.append("unheld"))
    assert woken[-1] == "unheld"


def test_the_memory_tiers_start_up_costs_a_rank_the_same_at_any_size(runs: dict[int, Run]) -> None:
    """Which ranks share a machine (8 to a machine): a rank other than 0 sends its key to rank 0 and
    receives its machine's ranks (a length, then the list), at any N; rank 0's count is linear."""
    for world, run in runs.items():
        counts = run.counts("memory group")
        assert [(c.messages_out, c.messages_in) for c in counts[1:]] == [(1, 2)] * (world - 1), world
        assert (counts[0].messages_in, counts[0].messages_out) == (world - 1, 2 * (world - 1)), world
        assert max(c.bytes_in for c in counts[1:]) < 100  # eight rank numbers, whatever N


# ------------------------------------------------------------------ the copies of memory snapshots (replicas=k)

OWN = 4096
"""Each rank's own state in a snapshot, beside its share of the replicated state (small: fast)."""


@pytest.fixture(scope="module")
def copies(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Run]:
    """Three machines of 8 (each copies to the next, the last to the first), and sixteen."""
    return {
        world: simulate(
            world, layers=4, restore_up_to=0, own_bytes=OWN, directory=str(tmp_path_factory.mktemp(f"copies{world}"))
        )
        for world in (24, 128)
    }


def test_a_ranks_copy_of_a_snapshot_costs_the_same_at_any_size(copies: dict[int, Run]) -> None:
    """Per snapshot every rank sends its keeper a header, its data and its envelope, and answers its
    own sender: 4 messages out, 4 in, two connections, no store operation and no collective, at 24
    and at 128 ranks; its bytes are what ``replica_parts.outgoing`` makes of its slot (the same but
    for the digits of rank numbers in its manifest): the slot's data less its share of the replicated
    state, which every other machine holds. Every copy measured was kept (its checksum matched)."""
    for world, run in copies.items():
        assert run.copies_kept == 16, world  # the first and the last machine's
        for rank, c in enumerate(run.counts(COPY_PHASE)):
            assert (c.messages_out, c.messages_in, c.connections(rank, world)) == (4, 4, 2), (world, rank)
            assert c.store_ops == 0 and c.all_gathers == 0 and not c.everyone, (world, rank)
        data, meta = slot(world, 0, RANKS_PER_MACHINE, 4, OWN)
        copy_data, envelope = sent(world, 0, RANKS_PER_MACHINE, 4, OWN)
        private = OWN + sum(
            t.numel() * t.element_size()
            for t in (torch.zeros(shape, dtype=dtype) for dtype, shape in PRIVATE_TENSORS.values())
        )
        assert copy_data == private < data and len(meta) < envelope < len(meta) + 1024, (copy_data, data, envelope)
        header, answer = 8 * 8, 8  # int64 values
        assert run.counts(COPY_PHASE)[0].bytes_out == header + copy_data + envelope + answer
        assert (run.slot_bytes, run.copy_sent_bytes) == (data + len(meta), copy_data + envelope)
    small, large = (copies[w].counts(COPY_PHASE) for w in (24, 128))
    for k in range(RANKS_PER_MACHINE):  # rank k of the last machine at either size
        before, after = small[24 - RANKS_PER_MACHINE + k], large[128 - RANKS_PER_MACHINE + k]
        assert 0 <= after.bytes_out - before.bytes_out <= 16 and 0 <= after.bytes_in - before.bytes_in <= 16, k


def test_the_counts_per_rank_are_those_of_every_ranks_real_copy(tmp_path: Path) -> None:
    """The simulator counts the copies of two machines and gives every other rank those of its
    local rank on the last machine: at 32 ranks, running every rank's real copy gives the same
    messages and partners, and bytes within the digits of rank numbers."""
    world = 32
    every = copy_counts(
        world, list(range(world)), per_machine=RANKS_PER_MACHINE, layers=4, own_bytes=OWN, directory=str(tmp_path)
    )
    sampled = copy_counts(
        world,
        measured_senders(world, RANKS_PER_MACHINE),
        per_machine=RANKS_PER_MACHINE,
        layers=4,
        own_bytes=OWN,
        directory=str(tmp_path),
    )
    assert sorted(sender for sender, _ in every.kept) == list(range(world)) and set(every.kept.values()) == {100}
    for rank, counted in enumerate(per_snapshot(world, RANKS_PER_MACHINE, sampled)):
        real = LinkCounts()
        for (_, _, who), c in every.counts.items():
            if who == rank:
                real.add(c)
        assert (counted.messages_out, counted.messages_in, counted.peers) == (
            real.messages_out,
            real.messages_in,
            real.peers,
        ), rank
        assert abs(counted.bytes_out - real.bytes_out) <= 16 and abs(counted.bytes_in - real.bytes_in) <= 16, rank


def _tree(rank: int, world: int) -> list[int]:
    """Rank ``rank``'s neighbours in ``tree_max``'s tree: its parent (none for rank 0) and its children."""
    first = TREE_ARITY * rank + 1
    return ([(rank - 1) // TREE_ARITY] if rank else []) + list(range(first, min(first + TREE_ARITY, world)))


def test_the_fetch_round_costs_a_rank_the_same_and_rank_0_linearly(copies: dict[int, Run]) -> None:
    """Machine 1 lost with its memory and disk: every rank ends with step 100, each of machine 1's
    ranks took one copy over, from the rank of machine 2 keeping it. A rank other than 0 sends its
    report and receives the plan (1 + 1 messages); a lost rank and its keeper also exchange the copy
    (a header's length, the header, the manifest, the data); and every rank takes part in one round
    of ``tree_max`` (one flag per lost rank: who still needs a copy), a message each way with its
    parent and each child. So at most 1 + 1 + 4 + 2 * (TREE_ARITY + 1) messages and TREE_ARITY + 3
    connections at any N. Rank 0 receives 1 message per rank (its gather), of the same size at any
    N, and broadcasts a plan that names only the lost machine's ranks."""
    for world, run in copies.items():
        assert {o.fetched for o in run.outcomes} == {100}, world
        lost = range(RANKS_PER_MACHINE, 2 * RANKS_PER_MACHINE)
        assert [o.adopted for o in run.outcomes] == [int(r in lost) for r in range(world)], world
        fetch = run.counts("fetch round")
        for rank, c in enumerate(fetch[1:], start=1):
            tree = _tree(rank, world)
            keeps = rank - RANKS_PER_MACHINE in lost
            expected = (1 + len(tree) + 4 * keeps, 1 + len(tree) + 4 * (rank in lost))  # (out, in)
            assert (c.messages_out, c.messages_in) == expected, (world, rank)
            partner = [rank + RANKS_PER_MACHINE] if rank in lost else [rank - RANKS_PER_MACHINE] if keeps else []
            assert c.peers == {0, *tree, *partner} and c.store_ops == 0, (world, rank, c.peers)
            assert c.messages_in + c.messages_out <= 6 + 2 * (TREE_ARITY + 1), (world, rank)
        tree = len(_tree(0, world))
        assert (fetch[0].messages_in, fetch[0].messages_out) == (world - 1 + tree,) * 2, world
    small, large = copies[24], copies[128]
    assert small.fetch_plan_bytes == large.fetch_plan_bytes < 200
    assert 0.9 < statistics.median(large.report_bytes) / statistics.median(small.report_bytes) < 1.1  # a survivor's
    assert max(large.report_bytes) <= max(small.report_bytes) + 8  # digits


def test_with_two_replicas_each_rank_copies_to_two_machines_and_a_lost_rank_has_two_keepers(tmp_path: Path) -> None:
    """``replicas=2`` at 32 ranks (4 machines): each rank sends its copy to the ranks of its local index
    on the next two machines, one after the other, and keeps those of the two machines before: 8
    messages out, 8 in, the same bytes per copy as with one keeper; 3 connections, as on 4 machines the
    machine two on both keeps a rank's copy and sends it its own. The fetch plan lists both keepers of
    each lost rank; the first one's copy is taken, in one round."""
    world, k = 32, 2
    run = simulate(world, layers=4, restore_up_to=0, own_bytes=OWN, directory=str(tmp_path), replicas=k)
    assert run.copies_kept == 16 * k  # the first and the last machine's, each kept by both keepers
    copy_data, envelope = sent(world, 0, RANKS_PER_MACHINE, 4, OWN)
    for rank, c in enumerate(run.counts(COPY_PHASE)):
        keepers = {(rank + j * RANKS_PER_MACHINE) % world for j in (1, 2)}
        senders = {(rank - j * RANKS_PER_MACHINE) % world for j in (1, 2)}
        assert (c.messages_out, c.messages_in, c.peers) == (4 * k, 4 * k, keepers | senders), (rank, c.peers)
        assert c.connections(rank, world) == 3 and c.store_ops == 0, (rank, c.peers)
    assert run.counts(COPY_PHASE)[0].bytes_out == k * (8 * 8 + copy_data + envelope + 8)
    plan = fetch_plan(Loss(world, RANKS_PER_MACHINE, replicas=k).reports())
    assert plan.pairs == [(rank, rank + j * RANKS_PER_MACHINE) for rank in range(8, 16) for j in (1, 2)]
    assert {o.fetched for o in run.outcomes} == {100}
    assert [o.adopted for o in run.outcomes] == [int(8 <= r < 16) for r in range(world)]


def test_rank_0s_plan_at_16384_ranks_names_only_the_lost_machine() -> None:
    """fetch_plan over 16,384 reports (one machine lost, the next keeping its copies): step 100, each
    lost rank from the rank of the next machine with its local index."""
    plan = fetch_plan(Loss(16384, RANKS_PER_MACHINE).reports())
    assert plan.step == 100
    assert plan.pairs == [(rank, rank + RANKS_PER_MACHINE) for rank in range(8, 16)]
