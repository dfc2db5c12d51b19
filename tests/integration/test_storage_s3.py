"""Checkpoints on a real S3-protocol server (moto's standalone server on loopback, via s3fs).

The server is conftest's ``s3_endpoint`` (a subprocess on a free loopback port). A writer is
SIGKILLed in the middle of a multipart upload, or between its data file and its manifest;
restore must then pick the last complete checkpoint, from the remote tier alone or from either tier.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import checkfreq as cf
from checkfreq.storage import FsspecStore
from helpers import SCRIPTS, assert_state_equal

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

KEY = {"key": "testing", "secret": "testing"}
STEPS = 3


@pytest.fixture
def bucket_url() -> str:
    return f"s3://ckpt-{uuid.uuid4().hex[:12]}/runs/exp1"


def _script():
    spec = importlib.util.spec_from_file_location("s3_train", SCRIPTS / "s3_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expected_after(steps: int) -> tuple[dict, dict]:
    """Model and optimizer state after ``steps`` steps of the script's training, computed here."""
    script = _script()
    model, optimizer = script.build()
    for step in range(1, steps + 1):
        script.train_step(model, optimizer, step)
    return model.state_dict(), optimizer.state_dict()


def restore_from(store: object, **kwargs: object) -> tuple[int, dict, dict]:
    model, optimizer = _script().build()
    with cf.Checkpointer(store, model=model, optimizer=optimizer, **kwargs) as ckpt:
        step = ckpt.restore()
    return step, model.state_dict(), optimizer.state_dict()


def run_child(s3_endpoint: str, url: str, *args: str) -> subprocess.Popen[str]:
    command = [
        sys.executable,
        str(SCRIPTS / "s3_train.py"),
        "--url",
        url,
        "--endpoint",
        s3_endpoint,
        "--steps",
        str(STEPS),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def kill_during_multipart_upload(proc: subprocess.Popen[str], s3_endpoint: str, url: str, step: int) -> None:
    """SIGKILL ``proc`` once step ``step``'s data file is a multipart upload with parts on the server."""
    fs = FsspecStore(url, endpoint_url=s3_endpoint, **KEY).fs
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    key = f"{prefix}/step_{step:09d}/rank00000.safetensors"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
        for upload in uploads:
            if upload["Key"] == key:
                parts = fs.call_s3("list_parts", Bucket=bucket, Key=key, UploadId=upload["UploadId"])
                if parts.get("Parts"):
                    proc.send_signal(signal.SIGKILL)
                    proc.communicate(timeout=30)
                    return
        time.sleep(0.05)
    out, err = proc.communicate(timeout=30)
    pytest.fail(f"never saw the upload of step {step} in progress (exit {proc.returncode})\n{out}{err}")


def test_s3_round_trip_and_layout(s3_endpoint: str, bucket_url: str) -> None:
    model, optimizer = _script().build()
    store = FsspecStore(bucket_url, endpoint_url=s3_endpoint, **KEY)
    with cf.Checkpointer(store, policy=2, keep=2, model=model, optimizer=optimizer) as ckpt:
        for step in range(1, 7):
            _script().train_step(model, optimizer, step)
            ckpt.step()
    assert [step for step, _ in store.checkpoints()] == [6, 4]  # keep=2 deleted step 2
    names = sorted(p.rsplit("/", 1)[1] for p in store.fs.find(bucket_url))
    assert names == ["manifest.json", "manifest.json", "rank00000.safetensors", "rank00000.safetensors"]
    step, model_state, optimizer_state = restore_from(FsspecStore(bucket_url, endpoint_url=s3_endpoint, **KEY))
    expected_model, expected_optimizer = expected_after(6)
    assert step == 6
    assert_state_equal(model_state, expected_model)
    assert_state_equal(optimizer_state, expected_optimizer)


def test_kill_mid_upload_restores_last_complete(s3_endpoint: str, bucket_url: str) -> None:
    proc = run_child(s3_endpoint, bucket_url, "--slow-step", str(STEPS))
    kill_during_multipart_upload(proc, s3_endpoint, bucket_url, STEPS)
    assert proc.returncode == -signal.SIGKILL
    store = FsspecStore(bucket_url, endpoint_url=s3_endpoint, **KEY)
    assert [step for step, _ in store.checkpoints()] == [2, 1]
    step, model_state, optimizer_state = restore_from(store)
    expected_model, expected_optimizer = expected_after(STEPS - 1)
    assert step == STEPS - 1
    assert_state_equal(model_state, expected_model)
    assert_state_equal(optimizer_state, expected_optimizer)


def test_kill_before_manifest_leaves_an_ignored_partial(s3_endpoint: str, bucket_url: str) -> None:
    proc = run_child(s3_endpoint, bucket_url, "--die-before-manifest", "3")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, out + err
    assert out.split() == ["committed", "1", "committed", "2"]
    store = FsspecStore(bucket_url, endpoint_url=s3_endpoint, **KEY)
    partial = f"{bucket_url}/step_000000003"
    assert store.fs.exists(f"{partial}/rank00000.safetensors")  # the data arrived, the manifest did not
    assert [step for step, _ in store.checkpoints()] == [2, 1]
    step, model_state, _ = restore_from(store)
    assert step == 2
    assert_state_equal(model_state, expected_after(2)[0])
    assert not store.fs.exists(partial)  # the next writer removed the uncommitted directory


def test_two_tiers_kill_mid_upload(s3_endpoint: str, bucket_url: str, tmp_path: Path) -> None:
    local = tmp_path / "fast"
    proc = run_child(s3_endpoint, bucket_url, "--local", str(local), "--slow-step", str(STEPS))
    kill_during_multipart_upload(proc, s3_endpoint, bucket_url, STEPS)
    assert proc.returncode == -signal.SIGKILL

    def remote() -> FsspecStore:
        return FsspecStore(bucket_url, endpoint_url=s3_endpoint, **KEY)

    # Same machine: the local tier holds the newest checkpoint, committed before its upload began.
    step, model_state, _ = restore_from(local, remote=remote())
    assert step == STEPS
    assert_state_equal(model_state, expected_after(STEPS)[0])
    # A fresh machine: only the remote tier, whose newest complete checkpoint is one older.
    step, model_state, optimizer_state = restore_from(tmp_path / "new-machine", remote=remote())
    assert step == STEPS - 1
    expected_model, expected_optimizer = expected_after(STEPS - 1)
    assert_state_equal(model_state, expected_model)
    assert_state_equal(optimizer_state, expected_optimizer)


def test_two_tiers_upload_and_keep_per_tier(s3_endpoint: str, bucket_url: str, tmp_path: Path) -> None:
    remote = FsspecStore(bucket_url, endpoint_url=s3_endpoint, **KEY)
    model, optimizer = _script().build()
    with cf.Checkpointer(
        tmp_path, remote=remote, policy=1, keep=1, remote_keep=3, model=model, optimizer=optimizer
    ) as ckpt:
        for step in range(1, 6):
            _script().train_step(model, optimizer, step)
            ckpt.step()
            ckpt.wait()
    # close() waited for the last upload; retention ran per tier.
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000000005"]
    remote_steps = [step for step, _ in remote.checkpoints()]
    assert remote_steps[0] == 5 and len(remote_steps) <= 3
    step, model_state, _ = restore_from(tmp_path / "elsewhere", remote=remote)
    assert step == 5
    assert_state_equal(model_state, expected_after(5)[0])


def test_failed_upload_is_reported_not_silent(s3_endpoint: str, bucket_url: str, tmp_path: Path) -> None:
    remote = FsspecStore(bucket_url, endpoint_url=s3_endpoint, **KEY)
    model, optimizer = _script().build()
    ckpt = cf.Checkpointer(tmp_path, remote=remote, policy=1, model=model, optimizer=optimizer)
    bucket = bucket_url.removeprefix("s3://").split("/", 1)[0]
    remote.fs.rm(bucket, recursive=True)  # the bucket is deleted under the running job
    remote.fs.invalidate_cache()
    _script().train_step(model, optimizer, 1)
    ckpt.step()
    with pytest.raises(cf.PersistError, match="copying a checkpoint to s3://"):
        ckpt.close()
    assert (tmp_path / "step_000000001" / "manifest.json").exists()  # the local tier still committed it


def test_a_damaged_checkpoint_is_marked_and_holds_no_retention_slot(s3_endpoint: str, bucket_url: str) -> None:
    """The newest checkpoint's data file truncated on the server: the restore skips it and marks it
    (``damaged.json``, every byte kept), and ``keep=2`` then keeps two valid checkpoints."""
    model, optimizer = _script().build()
    store = FsspecStore(bucket_url, endpoint_url=s3_endpoint, **KEY)
    with cf.Checkpointer(store, policy=2, keep=2, model=model, optimizer=optimizer) as ckpt:
        for step in range(1, 5):
            _script().train_step(model, optimizer, step)
            ckpt.step()
    data = f"{bucket_url}/step_{4:09d}/rank00000.safetensors"
    store.fs.pipe_file(data, store.fs.cat_file(data)[:-100])
    model, optimizer = _script().build()
    with cf.Checkpointer(store, policy=3, keep=2, model=model, optimizer=optimizer) as ckpt:
        assert ckpt.restore() == 2
        assert [(a.step, "bytes" in a.reason) for a in store.set_aside_checkpoints()] == [(4, True)]
        for step in range(3, 6):
            _script().train_step(model, optimizer, step)
            ckpt.step()  # a checkpoint at 5
        ckpt.wait()
        assert [step for step, _ in store.checkpoints()] == [5, 2]
        assert store.fs.exists(f"{bucket_url}/step_{4:09d}/damaged.json")
