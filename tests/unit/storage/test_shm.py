"""The memory tier's shared-memory region: layout, two slots, commit protocol, torn snapshots, hygiene."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from checkfreq.storage.shm import MemoryRegion, ShmSnapshotError, layout_signature
from checkfreq.storage.shm_listing import remove_regions_beyond
from checkfreq.storage.shm_paths import device_and_inode, region_path

SIG = layout_signature(("x",))


def put(region: MemoryRegion, step: int, nbytes: int = 4096) -> int:
    target = region.begin()
    target.data[:nbytes].fill_(step % 251)
    region.commit(target, step, nbytes, json.dumps({"step": step}).encode(), SIG)
    return target.slot


def test_two_slots_alternate_and_a_new_process_reads_the_newest(shm_dir: Path, tmp_path: Path) -> None:
    region = MemoryRegion.for_directory(tmp_path)
    assert not region.path.exists()  # nothing is created before reserve()
    region.reserve(4096, 100)
    assert region.path.parent == shm_dir and region.path == region_path(tmp_path, 0)
    slots = [put(region, step) for step in (1, 2, 3)]
    assert slots[0] != slots[1] and slots[0] == slots[2]
    region.release(remove=False)

    again = MemoryRegion.for_directory(tmp_path)  # as a restarted process would
    assert [i.step for i in again.snapshots()] == [3, 2]
    info, meta, data = again.newest()
    assert info.step == 3 and json.loads(meta) == {"step": 3} and bool((data == 3).all())
    assert again.newest(step=2)[0].step == 2
    put(again, 4)  # sequence numbers go on from the adopted region
    assert [i.step for i in again.snapshots()] == [4, 3]
    again.release(remove=True)
    assert not region.path.exists()


def test_flipped_bytes_are_detected_and_skipped(shm_dir: Path, tmp_path: Path) -> None:
    region = MemoryRegion.for_directory(tmp_path)
    region.reserve(8192, 100)
    put(region, 1, 8192)
    newest_slot = put(region, 2, 8192)
    at = 4096 + newest_slot * (region._data_capacity + region._meta_capacity) + 5000
    with open(region.path, "r+b") as f:  # a bit flips in the newest snapshot's data
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    info, _, data = region.newest()
    assert info.step == 1 and bool((data == 1).all())
    assert len(region.skipped) == 1 and "checksum" in region.skipped[0][1]

    with open(region.path, "r+b") as f:  # and one in the other slot's header
        f.seek(128 + info.slot * 128 + 20)
        f.write(b"\xff")
    assert region.newest() is None
    region.release(remove=True)


def test_a_reader_of_a_region_being_written_sees_committed_snapshots_only(shm_dir: Path, tmp_path: Path) -> None:
    writer = MemoryRegion.for_directory(tmp_path)
    writer.reserve(8192, 100)
    put(writer, 1, 8192)
    reader = MemoryRegion(region_path(tmp_path, 0), device_and_inode(tmp_path), tidy=False)  # as `checkfreq ls` looks
    target = writer.begin()  # a snapshot half copied into the other slot, its header not yet written
    target.data[:4096].fill_(2)
    assert [i.step for i in reader.snapshots()] == [1]
    writer.commit(target, 2, 8192, b'{"step": 2}', SIG)
    older = reader.snapshots()[1]
    assert [i.step for i in reader.snapshots()] == [2, 1] and bool((reader.read(older)[1] == 1).all())
    overwriting = writer.begin()  # the next snapshot reuses the older slot while the reader holds its header
    assert overwriting.slot == older.slot
    overwriting.data[:8192].fill_(3)
    with pytest.raises(ShmSnapshotError):
        reader.read(older)
    info, _, data = reader.newest()
    assert info.step == 2 and bool((data[:4096] == 2).all()) and reader.skipped == []
    reader.release(remove=False)
    writer.release(remove=True)


def test_region_of_an_earlier_directory_incarnation_is_removed(shm_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    region = MemoryRegion.for_directory(run)
    region.reserve(4096, 100)
    put(region, 7)
    region.release(remove=False)
    old_inode = run.stat().st_ino
    shutil.rmtree(run)
    for attempt in range(100):  # a new incarnation with another inode: a reused inode number is the same identity
        (tmp_path / f"elsewhere{attempt}").mkdir()
        run.mkdir()
        if run.stat().st_ino != old_inode:
            break
        run.rmdir()
    assert run.stat().st_ino != old_inode
    fresh = MemoryRegion.for_directory(run)
    assert not fresh.mapped and not fresh.path.exists() and fresh.newest() is None


WRITER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from checkfreq.storage.shm import MemoryRegion, layout_signature
    region = MemoryRegion.for_directory(sys.argv[1])
    nbytes, stop_at = int(sys.argv[2]), int(sys.argv[3])
    region.reserve(nbytes, 100)
    chunk = nbytes // 8
    for step in range(1, 10**6):
        target = region.begin()
        for i in range(8):
            target.data[i * chunk:(i + 1) * chunk].fill_(step % 251)
            if i == 3:
                print(f"half {step}", flush=True)
                if step == stop_at:
                    time.sleep(60)  # the parent kills it here, half-way through the copy
        region.commit(target, step, nbytes, json.dumps({"step": step}).encode(), layout_signature(("x",)))
        print(f"done {step}", flush=True)
    """
)


def run_and_kill(tmp_path: Path, *, at_half: int | None, delay: float = 0.0) -> tuple[int, int]:
    """Start the writer, SIGKILL it (at the half-way mark of snapshot ``at_half``, or ``delay`` s
    after its third snapshot); return (last announced half-way step, last committed step)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path), str(1 << 22), str(at_half or 0)],
        stdout=subprocess.PIPE,
        text=True,
    )
    half = done = 0
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            kind, step = line.split()
            if kind == "half":
                half = int(step)
                if half == at_half:
                    break
            else:
                done = int(step)
                if at_half is None and done == 3:
                    time.sleep(delay)
                    break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
    return half, done


def test_sigkill_during_the_copy_leaves_the_previous_complete_snapshot(shm_dir: Path, tmp_path: Path) -> None:
    half, done = run_and_kill(tmp_path, at_half=4)
    assert (half, done) == (4, 3)
    region = MemoryRegion.for_directory(tmp_path)
    assert [i.step for i in region.snapshots()] == [3]  # the slot being copied has no header
    info, meta, data = region.newest()
    assert info.step == 3 and json.loads(meta) == {"step": 3} and bool((data == 3).all())
    region.release(remove=True)


def test_sigkill_at_random_moments_always_leaves_a_complete_snapshot(shm_dir: Path, tmp_path: Path) -> None:
    rng = random.Random(18)
    for _ in range(3):
        _, done = run_and_kill(tmp_path, at_half=None, delay=rng.uniform(0, 0.02))
        region = MemoryRegion.for_directory(tmp_path)
        info, meta, data = region.newest()
        assert info.step >= done and json.loads(meta) == {"step": info.step}
        assert bool((data == info.step % 251).all())
        region.release(remove=True)


SMALL_TMPFS = textwrap.dedent(
    """
    import sys
    from checkfreq.storage.shm import MemoryRegion, ShmCapacityError
    region = MemoryRegion.for_directory(sys.argv[1])
    try:
        region.reserve(4 << 20, 100)
    except ShmCapacityError as e:
        print("refused:", e)
    import os
    print("left:", os.listdir(os.environ["CHECKFREQ_SHM_DIR"]))
    """
)


def test_a_small_tmpfs_is_refused_up_front(tmp_path: Path) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a private tmpfs")
    mount = tmp_path / "tinyshm"
    mount.mkdir()
    script = f'mount -t tmpfs -o size=1m tmpfs {mount} && CHECKFREQ_SHM_DIR={mount} exec "$0" -c "$1" "$2"'
    result = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, sys.executable, SMALL_TMPFS, str(tmp_path)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0 and "mount" in result.stderr:
        pytest.skip(f"cannot mount a private tmpfs here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout and "needs 8.1 MiB" in result.stdout and "--shm-size" in result.stdout
    assert "left: []" in result.stdout


def test_regions_of_ranks_a_smaller_job_lacks_are_removed(shm_dir: Path, tmp_path: Path) -> None:
    for rank in range(3):  # an earlier job ran with 3 ranks
        region = MemoryRegion.for_directory(tmp_path, rank)
        region.reserve(4096, 100)
        put(region, 5)
        region.release(remove=False)
    assert remove_regions_beyond(tmp_path, 2) == [region_path(tmp_path, 2)]
    assert sorted(p.name for p in shm_dir.iterdir()) == [region_path(tmp_path, r).name for r in (0, 1)]


def test_begin_never_touches_the_slot_being_persisted(shm_dir: Path, tmp_path: Path) -> None:
    region = MemoryRegion.for_directory(tmp_path)
    region.reserve(4096, 100)
    pinned = put(region, 1)
    for step in (2, 3, 4):
        target = region.begin(keep=pinned)
        assert target.slot != pinned
        target.data[:4096].fill_(step)
        region.commit(target, step, 4096, b"{}", SIG)
    assert sorted(i.step for i in region.snapshots()) == [1, 4]
    region.release(remove=True)


def test_a_region_of_three_slots_keeps_the_two_newest_snapshots_while_a_third_is_written(
    shm_dir: Path, tmp_path: Path
) -> None:
    region = MemoryRegion.for_directory(tmp_path, slots=3)
    region.reserve(4096, 100)
    assert region.slots == 3 and region.nbytes > 0
    for step in (1, 2, 3, 4, 5):
        target = region.begin()  # opened, its header invalidated: the two before it are whole
        assert sorted(i.step for i in region.snapshots()) == [s for s in (step - 2, step - 1) if s > 0]
        target.data[:4096].fill_(step)
        region.commit(target, step, 4096, b"{}", SIG)
    assert [i.step for i in region.snapshots()] == [5, 4, 3]
    region.release(remove=False)

    plain = MemoryRegion.for_directory(tmp_path)  # a restart without replicas= still reads it
    assert plain.slots == 3 and [i.step for i in plain.snapshots()] == [5, 4, 3]
    plain.reserve(4096, 100)  # its first snapshot makes a region of its own number of slots
    assert plain.slots == 2 and plain.snapshots() == []
    plain.release(remove=True)


def test_a_slot_held_by_a_persist_leaves_no_spare_slot_only_when_it_is_the_oldest(
    shm_dir: Path, tmp_path: Path
) -> None:
    region = MemoryRegion.for_directory(tmp_path, slots=3)
    region.reserve(4096, 100)
    slots = [put(region, step) for step in (1, 2, 3)]
    assert region.spare() and region.spare(keep=slots[2])
    assert not region.spare(keep=slots[0])  # only the second newest could be opened: the caller waits first
    assert region.begin(keep=slots[0]).slot == slots[1]
    region.release(remove=True)
