"""Distributed checkpointing: shared writes, the commit protocol, restarts, resharding.

The end-to-end tests run real ``torchrun --nproc-per-node 2`` jobs (CPU, gloo) of
``scripts/ddp_train.py`` and ``scripts/ddp_fsdp.py`` with real SIGKILLs.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from checkfreq import Checkpointer
from checkfreq.cli import app
from checkfreq.ranks.rebuild import Chunk, Source, materialize
from checkfreq.ranks.replicas import disagreement, fingerprint, report
from checkfreq.ranks.shares import partition, stream_range
from checkfreq.tools.report import load_run, summary_text
from helpers import (
    SCRIPTS,
    assert_each_sample_once_per_epoch,
    assert_state_equal,
    ddp_train_args,
    final_states,
    finish_job,
    incarnations,
    launch_job,
)

# ---------------------------------------------------------------------------- the plan, pure


def _uneven_sizes(seed: int) -> list[tuple[str, int, int]]:
    rng = random.Random(seed)
    sizes = [(f"layer{i}/weight", rng.choice([1, 7, 300, 5000, 120000]), rng.choice([2, 4, 8])) for i in range(12)]
    return sizes + [("step", 1, 8), ("empty", 0, 4)]


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("seed", range(5))
def test_partition_balances_bytes_and_covers_every_element_once(world: int, seed: int) -> None:
    sizes = _uneven_sizes(seed)
    plans = partition(sizes, world)
    assert plans == partition(list(reversed(sizes)), world)  # the same plan on every rank
    numel = {name: n for name, n, _ in sizes}
    itemsize = {name: s for name, _, s in sizes}
    total = sum(n * s for _, n, s in sizes)
    covered: dict[str, list[tuple[int, int]]] = {}
    for plan in plans:
        share = sum((p.end - p.begin) * itemsize[p.name] for p in plan)
        assert abs(share - total / world) <= total / world * 0.07 + 8
        for piece in plan:
            covered.setdefault(piece.name, []).append((piece.begin, piece.end))
            assert piece.whole == (piece.begin == 0 and piece.end == numel[piece.name])
    for name, n in numel.items():
        ranges = sorted(covered[name])
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)), name


def test_verification_windows_cover_every_element_once() -> None:
    sizes = _uneven_sizes(3)
    total = sum(n * s for _, n, s in sizes)
    covered: dict[str, list[tuple[int, int]]] = {}
    for k in range(7):
        for piece in stream_range(sizes, k * total // 7, (k + 1) * total // 7):
            covered.setdefault(piece.name, []).append((piece.begin, piece.end))
    for name, n, _ in sizes:
        ranges = sorted(covered.get(name, [(0, 0)]))
        assert ranges[0][0] == 0 and ranges[-1][1] == n, name
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)), name


def test_partition_keeps_small_tensors_whole() -> None:
    sizes = [("a", 1000, 4), ("b", 10, 4), ("c", 1000, 4)]  # the middle of the stream falls in b
    plans = partition(sizes, 2)
    assert [p for plan in plans for p in plan if p.name == "b"][0].whole


def test_reshard_cuts_any_box_from_saved_shards() -> None:
    full = torch.arange(35 * 3, dtype=torch.float32).view(35, 3)
    saved = Source(torch.float32, (35, 3), (Chunk(full[:18], (0, 0)), Chunk(full[18:], (18, 0))))
    assert torch.equal(materialize("w", saved, None), full)  # 2 -> 1
    columns = Source(torch.float32, (35, 3), (Chunk(full[:, :1], (0, 0)), Chunk(full[:, 1:], (0, 1))))
    assert torch.equal(materialize("w", columns, None), full)
    holes = Source(torch.float32, (35, 3), (Chunk(full[:18], (0, 0)),))
    with pytest.raises(Exception, match="cover 54 of the 105"):
        materialize("w", holes, None)


def test_replica_errors_name_the_entries_and_the_ranks() -> None:
    layout = (("model/w", "torch.float32", (4, 8)), ("optimizer/state/0/step", "torch.float32", ()))
    other = (("model/w", "torch.float64", (4, 8)),)
    same = [report(layout, {"model/w": "a"}) for _ in range(3)]
    assert disagreement(same) is None
    message = disagreement([*same[:2], report(other, {"model/w": "a"})])
    assert "'model/w' is torch.float32 (4, 8) on ranks [0, 1] but torch.float64 (4, 8) on ranks [2]" in message
    assert "'optimizer/state/0/step' is torch.float32 () on ranks [0, 1] but absent on ranks [2]" in message
    message = disagreement([report(layout, {"model/w[0:16]": h, "model/w[16:32]": "a"}) for h in ("a", "b", "a")])
    assert "'model/w[0:16]' holds 2 different values, on ranks [0, 2] and [1]" in message and "16:32" not in message
    assert fingerprint(torch.arange(6.0)) == fingerprint(torch.arange(6.0).view(2, 3).t().contiguous().t())
    assert fingerprint(torch.arange(6.0)) != fingerprint(torch.arange(6.0).flip(0))


# ---------------------------------------------------------------------------- real torchrun jobs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """For DDP with and without buffer broadcasts: an uninterrupted torchrun job and, at the same
    time, one killed two or three times and restarted.

    Every job registers BatchNorm (buffers that differ per rank after each forward), dropout, a
    per-rank plain tensor, a per-rank int and a value that is a tensor on rank 0 and a float on
    rank 1, and builds its loader before ``init_process_group``.
    """
    first = random.choice([1, 2, 4, 5])  # rank 0 dies between checkpoints
    last = random.choice([10, 11])  # rank 0 dies after checkpoint 9 is durable
    second = random.choice([4, 5, 7, 8])  # rank 1 dies between checkpoints
    plans = {  # LIFE:RANK:STEP:MODE; "persist": while the checkpoint of that step is written
        "broadcast": (f"0:0:{first}:step,1:1:6:persist,2:0:{last}:step", "1"),
        "local": (f"0:1:{second}:step,1:0:9:persist", "0"),
    }
    jobs = {}
    for name, (plan, broadcast) in plans.items():
        reference, killed = tmp_path_factory.mktemp(f"{name}-reference"), tmp_path_factory.mktemp(f"{name}-killed")
        extra = ("--broadcast-buffers", broadcast)
        jobs[name] = {
            "reference": reference,
            "killed": killed,
            "plan": plan,
            "procs": [
                launch_job(reference, "ddp_train.py", *ddp_train_args(reference, *extra)),
                launch_job(killed, "ddp_train.py", *ddp_train_args(killed, *extra, "--die", plan)),
            ],
        }
    for job in jobs.values():
        _, job["killed_out"] = [finish_job(p) for p in job.pop("procs")]
    after_first, after_second = (3 if first > 3 else 0), (6 if second > 6 else 3)
    jobs["broadcast"]["restored"] = [0, after_first, 3, 9]  # checkpoint 6 was never committed
    jobs["local"]["restored"] = [0, after_second, 6]  # nor checkpoint 9
    return jobs


@pytest.mark.slow
@pytest.mark.parametrize("buffers", ["broadcast", "local"])
def test_torchrun_restarts_after_kills_resume_exactly(runs: dict, buffers: str) -> None:
    job = runs[buffers]
    killed, plan = job["killed"], job["plan"]
    expected = [(life, r, step) for life, step in enumerate(job["restored"]) for r in (0, 1)]
    assert incarnations(job["killed_out"]) == expected, plan
    finals = final_states(killed)
    for _rank, (final, reference) in enumerate(zip(finals, final_states(job["reference"]), strict=True)):
        assert_state_equal(final, reference)  # model (BatchNorm buffers included), optimizer, values, RNG
    assert isinstance(finals[0]["mixed"], torch.Tensor) and isinstance(finals[1]["mixed"], float)
    assert not torch.equal(finals[0]["model"]["1.running_mean"], finals[1]["model"]["1.running_mean"])
    assert finals[0]["seen"] != finals[1]["seen"]
    assert_each_sample_once_per_epoch(killed / "batches.log")
    assert not [p.name for p in (killed / "ckpt").iterdir() if ".tmp-" in p.name]


@pytest.mark.slow
def test_each_rank_writes_its_share_and_the_log_counts_checkpoints_once(runs: dict) -> None:
    run = runs["broadcast"]["reference"]
    newest = max((run / "ckpt").glob("step_*"))
    sizes = [(newest / f"rank{r:05d}.safetensors").stat().st_size for r in (0, 1)]
    assert all(abs(s - sum(sizes) / 2) <= 0.1 * sum(sizes) / 2 for s in sizes), sizes
    # a world-size-1 process restores the shared state and rank 0's buffers (docs/distributed.md)
    import importlib.util

    spec = importlib.util.spec_from_file_location("ddp_train", SCRIPTS / "ddp_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    model = module.build_model()
    with Checkpointer(run / "ckpt", model=model, rng=False) as ckpt:
        ckpt["running"] = torch.zeros(8)
        assert ckpt.restore() == 12
        assert torch.equal(ckpt["running"], final_states(run)[0]["running"])
    assert_state_equal(model.state_dict(), final_states(run)[0]["model"])
    # every rank logged its events into the one log; the report counts each checkpoint once
    report = load_run(run / "ckpt")
    assert report.summary.checkpoints == report.summary.committed == 4  # steps 3, 6, 9, 12
    assert report.summary.sessions == 2  # the job and the restore above
    assert sorted(report.rank_stalls) == [0, 1] and len(report.rank_stalls[1]) == 4
    assert "stall per rank: rank 0 median" in summary_text(report)
    listed = CliRunner().invoke(app, ["ls", str(run / "ckpt"), "--json"])
    assert [c["step"] for c in json.loads(listed.output)] == [12, 9]


@pytest.mark.slow
def test_world_size_changes_follow_the_per_rank_rule(tmp_path: Path) -> None:
    """2 -> 1 -> 2: shared state carries over, per-rank state comes from saved rank ``r % saved world size``."""
    dump = tmp_path / "dump"
    dump.mkdir()
    args = ("--dump", str(dump))
    out = finish_job(
        launch_job(tmp_path, "ddp_train.py", *ddp_train_args(tmp_path, "--stop-at", "6", *args), restarts=0)
    )
    assert "restored step=0" in out
    out = finish_job(launch_job(tmp_path, "ddp_train.py", *ddp_train_args(tmp_path, "--stop-at", "11", *args), nproc=0))
    assert "rank=0 restored step=6 epoch=1 consumed=32" in out  # 2 -> 1
    out = finish_job(launch_job(tmp_path, "ddp_train.py", *ddp_train_args(tmp_path, *args)))
    assert out.count("restored step=11 epoch=2 consumed=8") == 2  # 1 -> 2
    state = {p.stem: torch.load(p) for p in dump.iterdir()}
    assert_state_equal(state["restored-w1-r0"], state["stopped-w2-r0"])  # rank 1's per-rank state is dropped
    assert not torch.equal(state["stopped-w2-r1"]["values"]["running"], state["stopped-w2-r0"]["values"]["running"])
    for rank in (0, 1):  # both new ranks start from the one saved rank
        assert_state_equal(state[f"restored-w2-r{rank}"], state["stopped-w1-r0"])
    assert final_states(tmp_path)
    assert_each_sample_once_per_epoch(tmp_path / "batches.log")


@pytest.mark.slow
def test_ranks_holding_different_parameters_stop_with_the_entry_named(tmp_path: Path) -> None:
    # on_error="warn" lets storage failures pass; a wrong training state is raised all the same
    args = ddp_train_args(tmp_path, "--diverge", "--on-error", "warn")
    out = finish_job(launch_job(tmp_path, "ddp_train.py", *args, restarts=0), expect_success=False)
    assert "ReplicaMismatchError: checkpoint 3 not committed: ranks disagree" in out
    assert "'model/0.weight' holds 2 different values, on ranks [0] and [1]" in out
    assert not list((tmp_path / "ckpt").glob("step_*"))


@pytest.mark.slow
def test_loader_built_before_the_process_group(tmp_path: Path) -> None:
    out = finish_job(launch_job(tmp_path, "loader_topology.py", restarts=0))
    indices = {int(r): set(map(int, i.split())) for r, i in re.findall(r"rank=(\d) indices=([\d ]+)", out)}
    assert indices[0] | indices[1] == set(range(12)) and not indices[0] & indices[1]
    assert (
        out.count("topology error: this loader partitions its samples for rank 0 of 1, but the job now has rank") == 2
    )


@pytest.mark.slow
def test_fsdp2_round_trip_and_reshard_to_one_process(tmp_path: Path) -> None:
    out = finish_job(
        launch_job(
            tmp_path, "ddp_fsdp.py", "--ckpt-dir", str(tmp_path / "ckpt"), "--expect", str(tmp_path / "expect.pt")
        )
    )
    assert "rank=0 fsdp round trip ok local_rows=17" in out and "rank=1 fsdp round trip ok local_rows=16" in out
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    with Checkpointer(tmp_path / "ckpt", model=model, optimizer=optimizer) as ckpt:
        assert ckpt.restore() == 3  # 2 -> 1: the shards are put together
    expected = torch.load(tmp_path / "expect.pt")
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[f"model/{key}"]), key
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(value, expected[f"optimizer/{index}/{key}"]), (index, key)
