"""Every byte of a checkpoint is checked, its manifest's too: an edited manifest, a manifest in the
directory of another step, and symbolic links (a file of a checkpoint, or a ``step_N`` directory)
are damage or reported, never read as the checkpoint they claim to be."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

import checkfreq as cf
from checkfreq.data import ResumableLoader
from checkfreq.pipeline.restore import read_checkpoint
from checkfreq.storage import FsspecStore
from checkfreq.storage.format import MANIFEST_CHECKSUM_KEY, MANIFEST_NAME, Manifest, seal_manifest
from checkfreq.tools.catalog import list_checkpoints
from helpers import make_model

STEPS, EVERY = 20, 5


def _objects() -> tuple[torch.nn.Module, torch.optim.Optimizer, ResumableLoader]:
    model = make_model()
    dataset = torch.utils.data.TensorDataset(torch.randn(400, 8), torch.randint(0, 3, (400,)))
    return model, torch.optim.Adam(model.parameters(), lr=0.001), ResumableLoader(dataset, batch_size=4, seed=0)


def _train(root: Path | str, steps: int = STEPS) -> int:
    """Train from what ``root`` holds to ``steps``, checkpointing every :data:`EVERY` steps; the step restored."""
    model, optimizer, loader = _objects()
    with cf.Checkpointer(root, model=model, optimizer=optimizer, loader=loader, policy=EVERY) as ckpt:
        restored = ckpt.restore()
        for x, y in loader:
            if ckpt.global_step == steps:
                break
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ckpt.step()
    return restored


def _restore(root: Path | str) -> tuple[int, torch.optim.Optimizer, ResumableLoader]:
    model, optimizer, loader = _objects()
    with cf.Checkpointer(root, model=model, optimizer=optimizer, loader=loader, policy=EVERY) as ckpt:
        return ckpt.restore(), optimizer, loader


def _edit(manifest: Path, pattern: str, replacement: str) -> None:
    """Change one value in ``manifest``'s text, as a person with an editor would."""
    text = manifest.read_text()
    edited, count = re.subn(pattern, replacement, text, count=1)
    assert count == 1 and edited != text
    manifest.write_text(edited)


@pytest.fixture
def run(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    assert _train(root) == 0
    assert [p.name for p in sorted(root.glob("step_*"))] == ["step_000000010", "step_000000015", "step_000000020"]
    return root


def _set_aside(root: Path) -> list[str]:
    return sorted(p.name.split(".")[0] for p in root.glob("step_*.damaged-*"))


@pytest.mark.parametrize(
    ("pattern", "replacement"),
    [(r'"lr": 0\.001', '"lr": 0.009'), (r'"consumed": (\d+)', '"consumed": 8')],
    ids=["lr", "consumed"],
)
def test_an_edited_manifest_is_damage_and_the_restore_takes_the_older_checkpoint(
    run: Path, pattern: str, replacement: str, caplog: pytest.LogCaptureFixture
) -> None:
    _edit(run / "step_000000020" / MANIFEST_NAME, pattern, replacement)
    with caplog.at_level(logging.WARNING, logger="checkfreq"):
        step, optimizer, loader = _restore(run)
    assert step == 15
    assert optimizer.param_groups[0]["lr"] == 0.001
    assert loader.state_dict()["consumed"] == 15 * 4
    assert _set_aside(run) == ["step_000000020"]
    assert any(
        "step_000000020" in r.message and f"{MANIFEST_NAME} fails its checksum" in r.message for r in caplog.records
    )


def test_verify_and_ls_fail_an_edited_manifest(run: Path) -> None:
    _edit(run / "step_000000020" / MANIFEST_NAME, r'"lr": 0\.001', '"lr": 0.009')
    statuses = {s.name: s for s in list_checkpoints(run)}
    assert [name for name, s in statuses.items() if not s.valid] == ["step_000000020"]
    assert statuses["step_000000020"].reason == (
        f"{MANIFEST_NAME} fails its checksum: it was edited or damaged after it was written"
    )
    assert not list_checkpoints(run, checksums=False)[0].valid  # ls --quick reads every byte of the manifest


def test_a_manifest_that_records_another_step_is_damage(run: Path) -> None:
    _edit(run / "step_000000020" / MANIFEST_NAME, r'"step": 20', '"step": 99999')
    step, _, _ = _restore(run)
    assert step == 15
    assert _set_aside(run) == ["step_000000020"]
    # sealed again, or moved whole into another step's directory: the name still disagrees
    moved = run / "step_000000030"
    shutil.copytree(run / "step_000000015", moved)
    with pytest.raises(cf.CorruptCheckpointError, match=r"records step 15, but it lies in step_000000030"):
        read_checkpoint(moved)
    assert _restore(run)[0] == 15
    assert _set_aside(run) == ["step_000000020", "step_000000030"]


def test_an_object_store_checks_its_manifests_the_same_way() -> None:
    url = f"memory://checkfreq-test-{uuid.uuid4().hex[:12]}/run"
    assert _train(url) == 0
    store = FsspecStore(url)
    path = str(store.location(20) / MANIFEST_NAME)
    store.fs.pipe_file(path, store.fs.cat_file(path).replace(b'"lr": 0.001', b'"lr": 0.009', 1))
    statuses = list_checkpoints(url)
    assert [(s.step, s.valid) for s in statuses] == [(20, False), (15, True), (10, True)]
    assert statuses[0].reason == f"{MANIFEST_NAME} fails its checksum: it was edited or damaged after it was written"
    step, optimizer, _ = _restore(url)
    assert (step, optimizer.param_groups[0]["lr"]) == (15, 0.001)


def test_the_checksum_covers_every_byte_and_its_own_place() -> None:
    manifest = Manifest(
        step=7, epoch=0, world_size=1, files={}, tensors={}, state={"lr": 0.001}, versions={}, created=1.0
    )
    raw = manifest.to_json()
    assert json.loads(raw)["schema_version"] == 3 and Manifest.from_json(raw, step=7) == manifest
    assert raw.endswith(b'"\n}') and json.loads(raw)[MANIFEST_CHECKSUM_KEY]
    for edited, reason in [
        (raw.replace(b"0.001", b"0.009"), "fails its checksum"),
        (raw.replace(b'"schema_version": 3', b'"schema_version": 2'), "fails its checksum"),
        (raw + b"\n", "malformed or not its last member"),
        (raw.replace(MANIFEST_CHECKSUM_KEY.encode(), b"manifest_xxh3_65"), "lacks its checksum"),
    ]:
        with pytest.raises(cf.CorruptCheckpointError, match=reason):
            Manifest.from_json(edited)
    resealed = seal_manifest({**json.loads(raw), "step": 8})  # whole, but in the place of another step
    assert Manifest.from_json(resealed).step == 8
    with pytest.raises(cf.CorruptCheckpointError, match="records step 8, but it lies in step_000000007"):
        Manifest.from_json(resealed, step=7)


def test_a_checkpoint_whose_manifest_has_no_checksum_still_restores(run: Path) -> None:
    """A manifest as schema version 2 wrote it (no checksum) is read; its step must still match its directory."""
    for name in ("step_000000015", "step_000000020"):
        path = run / name / MANIFEST_NAME
        doc = json.loads(path.read_bytes())
        del doc[MANIFEST_CHECKSUM_KEY]
        doc["schema_version"] = 2
        path.write_text(json.dumps(doc, indent=1))
    _edit(run / "step_000000020" / MANIFEST_NAME, r'"step": 20', '"step": 99999')
    step, optimizer, loader = _restore(run)
    assert (step, loader.state_dict()["consumed"]) == (15, 15 * 4)
    assert _set_aside(run) == ["step_000000020"]


@pytest.mark.parametrize("victim", ["rank00000.safetensors", MANIFEST_NAME])
def test_a_file_that_is_a_symbolic_link_is_damage(run: Path, tmp_path: Path, victim: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    path = run / "step_000000020" / victim
    shutil.move(path, outside / victim)  # the very same bytes, elsewhere
    path.symlink_to(outside / victim)
    with pytest.raises(cf.CorruptCheckpointError, match=f"{re.escape(victim)} is a symbolic link"):
        read_checkpoint(run / "step_000000020")
    assert _restore(run)[0] == 15
    assert _set_aside(run) == ["step_000000020"]
    assert (outside / victim).is_file()  # what it pointed to is left alone


def test_a_step_directory_that_is_a_symbolic_link_is_reported_and_never_left_behind(
    run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    outside = Path(shutil.copytree(run / "step_000000020", tmp_path / "elsewhere"))
    link = run / "step_000000030"
    link.symlink_to(outside)
    (status,) = [s for s in list_checkpoints(run) if s.name == link.name]
    assert (
        not status.valid
        and status.reason == f"a symbolic link (to {outside}), not a checkpoint directory: never restored"
    )
    with caplog.at_level(logging.WARNING, logger="checkfreq"):
        assert _train(run, steps=30) == 20  # the link is never restored, and step 30 is written over it
    said = {(r.name, r.getMessage()) for r in caplog.records}
    where = f"step_000000030 in {run} is a symbolic link (to {outside})"
    assert ("checkfreq.restore", f"{where}, not a checkpoint directory: never restored") in said
    assert ("checkfreq.storage.local", f"{where}, not a checkpoint: replaced by the checkpoint just written") in said
    assert not link.is_symlink() and (link / MANIFEST_NAME).is_file()
    assert not list(run.glob("*.tmp-*")) and sorted(p.name for p in outside.iterdir()) == sorted(
        p.name for p in (run / "step_000000020").iterdir()
    )
    # a leftover link of an earlier version is removed on the next start, its target kept
    leftover = run / "step_000000030.tmp-replaced-0123456789ab"
    leftover.symlink_to(outside)
    assert _restore(run)[0] == 30
    assert not leftover.is_symlink() and (outside / MANIFEST_NAME).is_file()


def test_verify_says_each_damage_once(run: Path) -> None:
    """Run as a user runs it: the command's own output and the library's log lines together."""
    data = run / "step_000000020" / "rank00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(raw)
    _edit(run / "step_000000015" / MANIFEST_NAME, r'"lr": 0\.001', '"lr": 0.009')
    done = subprocess.run(
        [sys.executable, "-c", "from checkfreq.command import main; main()", "verify", str(run)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    assert said.count("rank00000.safetensors fails its checksum") == 1, said
    assert said.count(f"{MANIFEST_NAME} fails its checksum") == 1, said
    assert "FAILED step_000000015: manifest.json fails its checksum" in said
    assert "1 of 3 checkpoints verified" in said
