"""Distributed checkpointing: shared writes, the commit protocol, restarts, resharding.

The end-to-end tests run real ``torchrun --nproc-per-node 2`` jobs (CPU, gloo) of
``scripts/ddp_train.py`` and ``scripts/ddp_fsdp.py`` with real SIGKILLs.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import psutil
import pytest
import torch
from conftest import SCRIPTS, assert_state_equal

from checkfreq import Checkpointer
from checkfreq.distributed_plan import Chunk, Source, materialize, partition

SAMPLES, BATCH, EPOCHS, EVERY = 64, 8, 3, 3  # world size 2: 4 steps per epoch, 12 in all


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
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), name


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


# ---------------------------------------------------------------------------- real torchrun jobs


def _launch(workdir: Path, script: str, *args: str, nproc: int = 2) -> subprocess.Popen[str]:
    # torchrun's shared rendezvous store can hand a restarted worker its predecessor's address
    # (pytorch/pytorch#135712): give the workers their own store, as docs/distributed.md advises.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if nproc:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   "--max-restarts=3", "--monitor-interval=0.1", str(SCRIPTS / script), *args]
    else:  # one plain process, no process group
        command = [sys.executable, str(SCRIPTS / script), *args]
    return subprocess.Popen(command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)


def _finish(proc: subprocess.Popen[str]) -> str:
    try:
        out, _ = proc.communicate(timeout=480)
    finally:
        if proc.poll() is None:  # timed out: torchrun's workers run in sessions of their own
            _kill_tree(proc.pid)
    assert proc.returncode == 0, out[-4000:]
    return out


def _kill_tree(pid: int) -> None:
    try:
        processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    assert proc.returncode == 0, out[-4000:]
    return out


def _train_args(workdir: Path, *extra: str) -> list[str]:
    return ["--ckpt-dir", str(workdir / "ckpt"), "--final", str(workdir / "final.pt"),
            "--batch-log", str(workdir / "batches.log"), "--samples", str(SAMPLES), "--batch-size", str(BATCH),
            "--epochs", str(EPOCHS), "--every", str(EVERY), *extra]


def _restores(out: str) -> list[tuple[int, int, int]]:
    """(life, rank, restored step) for every incarnation of every rank."""
    return sorted((int(a), int(b), int(c)) for a, b, c in re.findall(r"life=(\d+) rank=(\d+) restored step=(\d+)", out))


def _assert_each_sample_once_per_epoch(log: Path) -> None:
    """The last line for each (rank, epoch, position) is what training used: a replay replaces its line."""
    batches: dict[tuple[str, str, str], list[int]] = {}
    for line in log.read_text().splitlines():
        rank, epoch, consumed, *indices = line.split()
        batches[(rank, epoch, consumed)] = [int(i) for i in indices]
    for epoch in range(EPOCHS):
        seen = Counter(i for (_, e, _), idx in batches.items() if int(e) == epoch for i in idx)
        assert sorted(seen) == list(range(SAMPLES)) and set(seen.values()) == {1}, f"epoch {epoch}: {seen}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """An uninterrupted torchrun job and, at the same time, one killed three times and restarted."""
    reference, killed = tmp_path_factory.mktemp("reference"), tmp_path_factory.mktemp("killed")
    first = random.choice([1, 2, 4, 5])  # rank 0 dies between checkpoints
    last = random.choice([10, 11])  # rank 0 dies after checkpoint 9 is durable
    plan = f"0:0:{first}:step,1:1:6:persist,2:0:{last}:step"  # rank 1 dies while checkpoint 6 is written
    procs = [_launch(reference, "ddp_train.py", *_train_args(reference)),
             _launch(killed, "ddp_train.py", *_train_args(killed, "--die", plan))]
    outs = [_finish(p) for p in procs]
    return {"reference": reference, "killed": killed, "killed_out": outs[1], "first": first, "plan": plan}


@pytest.mark.slow
def test_torchrun_restarts_after_kills_resume_exactly(runs: dict) -> None:
    killed, plan = runs["killed"], runs["plan"]
    after_first = 3 if runs["first"] > 3 else 0
    expected = [(0, r, 0) for r in (0, 1)] + [(1, r, after_first) for r in (0, 1)]
    expected += [(2, r, 3) for r in (0, 1)] + [(3, r, 9) for r in (0, 1)]  # checkpoint 6 was never committed
    assert _restores(runs["killed_out"]) == expected, plan
    final = torch.load(killed / "final.pt")
    assert_state_equal(final, torch.load(runs["reference"] / "final.pt"))
    _assert_each_sample_once_per_epoch(killed / "batches.log")
    assert not [p.name for p in (killed / "ckpt").iterdir() if ".tmp-" in p.name]


@pytest.mark.slow
def test_each_rank_writes_its_share_of_the_bytes(runs: dict) -> None:
    newest = max((runs["reference"] / "ckpt").glob("step_*"))
    sizes = [(newest / f"rank{r:05d}.safetensors").stat().st_size for r in (0, 1)]
    assert all(abs(s - sum(sizes) / 2) <= 0.1 * sum(sizes) / 2 for s in sizes), sizes
    # and a world-size-1 process restores the whole state from the two files
    import importlib.util

    spec = importlib.util.spec_from_file_location("ddp_train", SCRIPTS / "ddp_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    model = module.build_model()
    with Checkpointer(runs["reference"] / "ckpt", model=model, rng=False) as ckpt:
        assert ckpt.restore() == 12
    assert_state_equal(model.state_dict(), torch.load(runs["reference"] / "final.pt")["model"])


@pytest.mark.slow
def test_world_size_changes_keep_each_sample_once_per_epoch(tmp_path: Path) -> None:
    out = _finish(_launch(tmp_path, "ddp_train.py", *_train_args(tmp_path, "--stop-at", "6")))
    assert "restored step=0" in out
    out = _finish(_launch(tmp_path, "ddp_train.py", *_train_args(tmp_path, "--stop-at", "11"), nproc=0))
    assert "rank=0 restored step=6 epoch=1 consumed=32" in out  # 2 -> 1
    out = _finish(_launch(tmp_path, "ddp_train.py", *_train_args(tmp_path)))
    assert out.count("restored step=11 epoch=2 consumed=8") == 2  # 1 -> 2
    assert (tmp_path / "final.pt").exists()
    _assert_each_sample_once_per_epoch(tmp_path / "batches.log")


@pytest.mark.slow
def test_fsdp2_round_trip_and_reshard_to_one_process(tmp_path: Path) -> None:
    out = _finish(_launch(tmp_path, "ddp_fsdp.py", "--ckpt-dir", str(tmp_path / "ckpt"), "--expect", str(tmp_path / "expect.pt")))
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
