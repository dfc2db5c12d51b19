"""The memory tier in the Checkpointer: a killed process restarts from shared memory, exactly."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import checkfreq as cf
from checkfreq.cli import app
from checkfreq.pipeline.tiers.memory.tier import MemoryTier
from checkfreq.policies.memory_cadence import MemoryCadence
from checkfreq.run.events import read_events
from checkfreq.storage import shm
from checkfreq.storage.format import data_file_name
from checkfreq.storage.shm import MemoryRegion
from checkfreq.storage.shm_paths import SHM_DIR_ENV, device_and_inode, region_path
from helpers import SCRIPTS, make_model, train_step

SCRIPT = SCRIPTS / "chaos_train.py"
ARGS = ["--epochs", "3", "--every", "8"]  # 8 steps an epoch: 24 steps, persists at 8, 16, 24


def train(
    directory: Path, *extra: str, kill_after: int | None = None, while_stopped: Callable[[], None] = lambda: None
) -> dict[str, str]:
    """Run the training script; SIGKILL it once step ``kill_after + 2`` has begun (the memory
    snapshot of step ``kill_after`` is complete by then), or where a ``--hook`` in ``extra``
    stopped it (after calling ``while_stopped``). Returns the last line of each kind."""
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--dir", str(directory), *ARGS, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: dict[str, str] = {}
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            kind, _, value = line.strip().partition(" ")
            lines[kind] = value
            if kind == "chaos":
                while_stopped()
            if kind == "chaos" or (kill_after is not None and kind == "optimizer" and int(value) == kill_after + 2):
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.wait(timeout=120)
        stderr = proc.stderr.read()  # type: ignore[union-attr]
        proc.stdout.close(), proc.stderr.close()  # type: ignore[union-attr]
    if "chaos" not in lines and kill_after is None:
        assert proc.returncode == 0, stderr[-3000:]
    lines["stderr"] = stderr
    return lines


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The final state digest of the run, uninterrupted and without the memory tier."""
    return train(tmp_path_factory.mktemp("reference"))["final"]


def test_a_killed_run_restarts_from_memory_and_ends_bit_identical(
    shm_dir: Path, tmp_path: Path, reference: str
) -> None:

    run = tmp_path / "run"
    train(run, "--memory", "1", kill_after=13)
    assert region_path(run, 0).exists()  # the killed process left its snapshots behind
    resumed = train(run, "--memory", "1")
    restored = int(resumed["ready"])
    assert restored >= 13 > 8  # the newest disk checkpoint is step 8: memory lost at most 1 step
    assert resumed["final"] == reference
    restore = [e for e in read_events(run) if e["event"] == "restore"][-1]
    assert restore["tier"] == "memory" and restore["step"] == restored
    assert not region_path(run, 0).exists()  # a clean close removes the region


def test_without_the_region_both_restart_from_disk_and_end_bit_identical(
    shm_dir: Path, tmp_path: Path, reference: str
) -> None:
    run = tmp_path / "run"
    train(run, "--memory", "1", kill_after=13)
    region_path(run, 0).unlink()  # e.g. the node rebooted
    # 8 unless still persisting
    on_disk = max((int(p.name[5:]) for p in run.glob("step_*") if p.name[5:].isdigit()), default=0)
    resumed = train(run, "--memory", "1")
    assert int(resumed["ready"]) == on_disk and resumed["final"] == reference


def test_a_torn_newest_snapshot_falls_back_to_the_previous_one(shm_dir: Path, tmp_path: Path, reference: str) -> None:
    run = tmp_path / "run"
    train(run, "--memory", "1", "--hook", "slot", "--hook-at", "15")  # killed with both slots committed
    path = region_path(run, 0)
    region = MemoryRegion.for_directory(run)
    newest, older = region.snapshots()
    at = 4096 + newest.slot * (region._data_capacity + region._meta_capacity) + 100
    region.release(remove=False)
    with open(path, "r+b") as f:  # flip a byte of the newest snapshot's data
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 1]))
    listing = json.loads(CliRunner().invoke(app, ["ls", str(run), "--json"]).output)
    memory = [(e["step"], e["valid"], e["reason"] or "") for e in listing if e["tier"] == "memory"]
    assert memory[0][:2] == (newest.step, False) and "checksum" in memory[0][2] and memory[1] == (older.step, True, "")
    resumed = train(run, "--memory", "1")
    assert int(resumed["ready"]) == older.step and resumed["final"] == reference
    restore = [e for e in read_events(run) if e["event"] == "restore"][-1]
    assert restore["tier"] == "memory" and "checksum" in restore["skipped"][0][1]


def test_a_restore_hashes_the_chosen_snapshot_once_and_no_other_slot(
    shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    train(run, "--memory", "1", "--hook", "slot", "--hook-at", "15")  # killed with both slots committed
    hashed: list[int] = []
    digest = shm.slot_digest
    monkeypatch.setattr(shm, "slot_digest", lambda data, meta: hashed.append(len(data)) or digest(data, meta))
    tier = MemoryTier(run, MemoryCadence(every=1), data_file=data_file_name(0))
    states, skipped = tier.snapshots()
    assert len(states) == 2 and not skipped and hashed == []  # listed from headers and sealed manifests
    chosen = tier.complete(states[0])
    assert hashed == [chosen.manifest.files[data_file_name(0)]["size"]]  # the bytes restored, once
    tier.close(remove=False)


def test_a_region_read_while_a_snapshot_is_being_committed_shows_only_complete_ones(
    shm_dir: Path, tmp_path: Path, reference: str
) -> None:
    """The writer stopped, alive, between copying step 14's snapshot and writing its header: a
    reader sees only older, complete snapshots; killed there, the run resumes from one of them."""
    run = tmp_path / "run"
    seen: dict[str, list] = {}  # type: ignore[type-arg]

    def look() -> None:
        region = MemoryRegion(region_path(run, 0), device_and_inode(run), tidy=False)
        newest = region.newest()
        seen["steps"] = [info.step for info in region.snapshots()]
        seen["newest"] = [] if newest is None else [newest[0].step]
        region.release(remove=False)
        listing = json.loads(CliRunner().invoke(app, ["ls", str(run), "--json"]).output)
        seen["listed"] = [(e["step"], e["valid"]) for e in listing if e["tier"] == "memory"]

    train(run, "--memory", "1", "--hook", "header", "--hook-at", "14", while_stopped=look)
    steps = seen["steps"]
    assert len(steps) == 1 and steps[0] < 14 and seen["newest"] == steps, seen
    assert seen["listed"] == [(steps[0], True)], seen
    resumed = train(run, "--memory", "1")
    assert int(resumed["ready"]) == steps[0] and resumed["final"] == reference


def test_a_small_tmpfs_means_disk_only_with_one_warning(tmp_path: Path, reference: str) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a private tmpfs")
    mount = tmp_path / "tinyshm"
    mount.mkdir()
    run = tmp_path / "run"
    script = f'mount -t tmpfs -o size=64k tmpfs {mount} && {SHM_DIR_ENV}={mount} exec "$@"'
    result = subprocess.run(
        [
            "unshare",
            "-rm",
            "sh",
            "-c",
            script,
            "sh",
            sys.executable,
            str(SCRIPT),
            "--dir",
            str(run),
            *ARGS,
            "--memory",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode != 0 and "mount" in result.stderr:
        pytest.skip(f"cannot mount a private tmpfs here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("memory tier off, checkpoints go to disk only") == 1
    assert result.stdout.strip().splitlines()[-1] == f"final {reference}"
    assert sorted(p.name for p in run.glob("step_*")) == ["step_000000016", "step_000000024"]


def test_memory_stays_flat_over_thousands_of_snapshots(shm_dir: Path, tmp_path: Path) -> None:
    psutil = pytest.importorskip("psutil")
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    process = psutil.Process()
    with cf.Checkpointer(tmp_path, policy=1000, memory=1, model=model, optimizer=optimizer) as ckpt:
        for step in range(1, 2001):
            train_step(model, optimizer, batch=4)
            ckpt.step()
            if step == 200:
                rss, size = process.memory_info().rss, region_path(tmp_path, 0).stat().st_size
        assert process.memory_info().rss - rss < 8 << 20
        assert region_path(tmp_path, 0).stat().st_size == size
        assert [p.name for p in shm_dir.iterdir()] == [region_path(tmp_path, 0).name]
    memory = [e for e in read_events(tmp_path) if e["event"] == "memory"]
    assert len(memory) == 2000 - 2  # every step but the two persists
    assert not any(shm_dir.iterdir())


def test_a_run_that_did_not_restore_refuses_to_overwrite_memory_snapshots(shm_dir: Path, tmp_path: Path) -> None:
    train(tmp_path / "run", "--memory", "1", "--hook", "slot", "--hook-at", "6")  # killed before its first persist (8)
    assert not list((tmp_path / "run").glob("step_*"))
    model = make_model()
    with cf.Checkpointer(tmp_path / "run", policy=8, memory=True, model=model) as ckpt:
        with pytest.raises(cf.errors.ExistingCheckpointsError):
            ckpt.step()  # a memory snapshot would overwrite them
        with pytest.raises(cf.errors.ExistingCheckpointsError):
            ckpt.save()
    assert region_path(tmp_path / "run", 0).exists()  # closing never removes another run's snapshots


def test_one_process_removes_the_regions_of_ranks_it_does_not_have(shm_dir: Path, tmp_path: Path) -> None:
    """An earlier 2-rank job left its regions: a single process (a world of one) on the directory
    removes rank 1's as it starts, as any job does with the ranks it lacks, and keeps its own."""
    run = tmp_path / "run"
    run.mkdir()
    for rank in (0, 1):
        region = MemoryRegion.for_directory(run, rank)
        region.reserve(4096, 100)
        region.release(remove=False)
    with cf.Checkpointer(run, memory=1, model=make_model()):
        assert sorted(p.name for p in shm_dir.iterdir()) == [region_path(run, 0).name]


def test_memory_option_is_checked(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="memory must be"):
        cf.Checkpointer(tmp_path, memory=0.5, model=make_model())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="memory must be"):
        cf.Checkpointer(tmp_path, memory=-1, model=make_model())


def test_memory_cadence_fixed_and_within_the_overhead_bound() -> None:
    fixed = MemoryCadence(every=3)
    assert [s for s in range(1, 10) if fixed.due(s, 0.1) and fixed.taken(s) is None] == [3, 6, 9]
    auto = MemoryCadence()
    assert auto.interval(float("nan")) == 1  # not measured yet: snapshot, which measures it
    auto.record(1.0)  # the first snapshot pays one-time costs: left out
    assert auto.interval(0.1) == 1
    auto.record(0.01)
    assert auto.interval(0.1) == 3  # 0.01 s every 3 steps of 0.1 s is within 3.5 %
    assert auto.interval(1.0) == 1
    auto.record_background(0.02)  # the tier's thread copied and hashed for 20 ms: that slows training too
    assert auto.interval(0.1) == 9  # (0.01 + 0.02) s within 3.5 % of 0.1 s steps
    with pytest.raises(ValueError):
        MemoryCadence(every=0)


def _compute(seconds: float) -> None:
    """A step's compute: ``seconds`` of this thread's CPU time. On a loaded machine it takes longer, as the
    snapshot's copy does (a sleep would not, and would make every snapshot look costly there)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_default_cadence_snapshots_every_step_when_cheap_and_spaces_out_when_not(shm_dir: Path, tmp_path: Path) -> None:
    cheap, tick = torch.nn.Linear(4, 4), torch.nn.Linear(1, 1)  # tick's forward: each step's consistent point
    with cf.Checkpointer(tmp_path / "cheap", policy=1000, memory=True, model=cheap, tick=tick) as ckpt:
        for _ in range(20):
            tick(torch.ones(1))
            _compute(0.3)  # after the point: far longer than copying 20 floats
            ckpt.step()
    cheap_steps = [e["step"] for e in read_events(tmp_path / "cheap") if e["event"] == "memory"]
    # every step, but for a hiccup of a busy machine (step 2's too)
    assert cheap_steps[0] == 1 and len(cheap_steps) >= 16

    heavy = torch.nn.Linear(2048, 2048)  # 16 MiB to copy, nothing else per step
    with cf.Checkpointer(tmp_path / "heavy", policy=1000, memory=True, model=heavy, tick=tick) as ckpt:
        for _ in range(30):
            tick(torch.ones(1))
            ckpt.step()
    heavy_steps = [e["step"] for e in read_events(tmp_path / "heavy") if e["event"] == "memory"]
    # no training at all: an iteration is the loop's microseconds (the snapshots' stalls, creating the region
    # included, are not iteration time), so once step 2 has measured the copy, 3.5 % allows no more in 30 steps;
    # a hiccup of a busy machine in the first measured iteration may allow one or two
    assert heavy_steps[:2] == [1, 2] and len(heavy_steps) <= 6 < len(cheap_steps)


class StallsOnce:
    """A registered object whose first ``state_dict()`` blocks the training thread ``seconds``:
    a known stall injected into the first snapshot of a session."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.calls = seconds, 0

    def state_dict(self) -> dict:
        self.calls += 1
        if self.calls == 1:
            time.sleep(self.seconds)
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_memory_snapshot_stalls_are_not_iteration_time_in_a_fresh_and_a_resumed_session(
    shm_dir: Path, tmp_path: Path
) -> None:
    """Each session's first memory snapshot creates the region (the clean close removed it) and, here,
    stalls a second more: the profiler leaves that out of the iteration it falls in, as a checkpoint's stall."""
    stall = 1.0
    first_steps = []
    for _ in range(2):
        assert not region_path(tmp_path, 0).exists()  # the session's first memory snapshot creates it
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        with cf.Checkpointer(
            tmp_path, policy=1000, memory=True, model=model, optimizer=optimizer, slow=StallsOnce(stall)
        ) as ckpt:
            first_steps.append(ckpt.restore() + 1)  # the resumed session restores what the first one persisted at close
            for _ in range(3):
                train_step(model, optimizer)
                ckpt.step()
            assert ckpt.profiler.iteration.count >= 2  # measured: the first iteration of the session holds the stall
            assert ckpt.profiler.iteration.value < stall / 2
    memory = {e["step"]: e for e in read_events(tmp_path) if e["event"] == "memory"}
    assert first_steps[1] > first_steps[0] and all(memory[s]["stall_s"] >= stall for s in first_steps)


def test_report_shows_memory_snapshots_apart_from_persists(shm_dir: Path, tmp_path: Path) -> None:
    from checkfreq.tools.report import load_run, summary_text
    from checkfreq.tools.report_files import render_figure

    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with cf.Checkpointer(tmp_path, policy=5, memory=1, model=model, optimizer=optimizer) as ckpt:
        for _ in range(12):
            train_step(model, optimizer)
            ckpt.step()
    report = load_run(tmp_path)
    assert [r.step for r in report.records] == [5, 10, 12]  # 12: the newest memory snapshot, persisted at close
    assert [m["step"] for m in report.memory_snapshots] == [1, 2, 3, 4, 6, 7, 8, 9, 11, 12]
    assert "memory tier: 10 snapshots besides the checkpoints" in summary_text(report)
    labels = [line.get_label() for line in render_figure(report).axes[1].get_lines()]
    assert "memory snapshot" in labels and "checkpoint (persisted)" in labels
