"""Node-local directories written by two real gloo ranks, each with a directory of its own (two
"nodes") and one remote tier: restoring from them (files sent between ranks, not read from the
remote tier), and ``checkfreq ls``, ``verify`` and ``report`` on one node's directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from typer.testing import CliRunner

from checkfreq import Checkpointer
from checkfreq.cli import app
from checkfreq.storage.format import seal_manifest
from checkfreq.storage.local import LocalStore
from checkfreq.tools.catalog import list_checkpoints
from checkfreq.tools.report import load_run
from helpers import make_model, spawn_ranks, train_step

STEPS, EVERY = 6, 3


def _rank(rank: int, root: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{root}/store", 2), rank=rank, world_size=2)
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(f"{root}/node{rank}", remote=f"{root}/remote", policy=EVERY, model=model, optimizer=optimizer)
    for _ in range(STEPS):
        train_step(ddp, optimizer)
        ckpt.step()
        ckpt.wait(remote=True)
    ckpt.close()
    torch.save(model.state_dict(), f"{root}/final{rank}.pt")
    dist.destroy_process_group()


def _restore(rank: int, root: str, directories: list[str]) -> None:
    """Restore from ``directories[rank]`` with no remote tier, and save what was restored."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{root}/store-restore", 2), rank=rank, world_size=2)
    model = make_model(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(directories[rank], policy=EVERY, model=model, optimizer=optimizer)
    step = ckpt.restore()
    torch.save({"step": step, "model": model.state_dict()}, f"{root}/restored{rank}.pt")
    ckpt.close()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("nodes")
    spawn_ranks(_rank, (str(root),), 2)
    return root


def _cli(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(app, [str(a) for a in args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


@pytest.mark.parametrize("damaged", [False, True], ids=["intact", "damaged"])
def test_ranks_restore_from_each_others_directories_without_the_remote_tier(
    nodes: Path, tmp_path: Path, damaged: bool
) -> None:
    """The ranks come back on each other's node (as torchrun's c10d rendezvous may number them) and
    no remote tier is given: each rank reads the file its directory holds and receives the other's.
    With rank 0's file of the newest checkpoint damaged on the only node holding it, both ranks
    take the one before."""
    import shutil

    swapped = [str(shutil.copytree(nodes / f"node{1 - rank}", tmp_path / f"node{1 - rank}")) for rank in (0, 1)]
    if damaged:
        path = tmp_path / "node0" / "step_000000006" / "rank00000.safetensors"
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
    spawn_ranks(_restore, (str(tmp_path), swapped), 2)
    step = EVERY if damaged else STEPS
    for rank in (0, 1):
        restored = torch.load(tmp_path / f"restored{rank}.pt")
        assert restored["step"] == step
        if not damaged:
            final = torch.load(nodes / "final0.pt")
            assert all(torch.equal(restored["model"][k], v) for k, v in final.items())
        events = [json.loads(line) for line in (Path(swapped[rank]) / "events.jsonl").read_text().splitlines()]
        restores = [e for e in events if e["event"] == "restore"]
        assert [(e["rank"], e["step"], e["tier"]) for e in restores] == [(rank, step, "local+peer")]
        if damaged:
            assert "fails its checksum" in restores[0]["skipped"][0][1]
            # Unrestorable as a whole: each node's leader set aside its directory's copy, after the ranks agreed.
            store = LocalStore(swapped[rank])
            assert [s for s, _ in store.checkpoints()] == [EVERY]
            aside = store.set_aside_checkpoints()
            assert [(a.step, "fails its checksum" in a.reason) for a in aside] == [(STEPS, True)]


def test_a_damaged_copy_is_replaced_by_another_directorys_intact_one(nodes: Path, tmp_path: Path) -> None:
    """Both directories hold every file of the newest checkpoint (the other node's copied in), and
    rank 0's own file is damaged in rank 0's directory: rank 1's directory gives its intact copy, read
    there once and sent to rank 0, and both ranks restore the newest step, exactly."""
    import shutil

    directories = [tmp_path / f"node{rank}" for rank in (0, 1)]
    for rank, directory in enumerate(directories):
        shutil.copytree(nodes / f"node{rank}", directory)
        newest = directory / f"step_{STEPS:09d}"
        other = f"rank{1 - rank:05d}.safetensors"
        shutil.copy(nodes / f"node{1 - rank}" / newest.name / other, newest / other)
    path = directories[0] / f"step_{STEPS:09d}" / "rank00000.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    spawn_ranks(_restore, (str(tmp_path), [str(d) for d in directories]), 2)
    final = torch.load(nodes / "final0.pt")
    for rank, directory in enumerate(directories):
        restored = torch.load(tmp_path / f"restored{rank}.pt")
        assert restored["step"] == STEPS
        assert all(torch.equal(restored["model"][k], v) for k, v in final.items())
        events = [json.loads(line) for line in (directory / "events.jsonl").read_text().splitlines()]
        restores = [e for e in events if e["event"] == "restore"]
        # rank 0: its file from rank 1, rank 1's pieces from rank 1; rank 1: both files read itself
        assert [(e["step"], e["tier"], e["skipped"]) for e in restores] == [
            (STEPS, "peer" if rank == 0 else "local", [])
        ]


def test_a_node_directory_holds_its_ranks_files_and_names_the_others(nodes: Path) -> None:
    for rank, other in ((0, 1), (1, 0)):
        statuses = list_checkpoints(nodes / f"node{rank}")
        assert [(s.step, s.valid, s.elsewhere) for s in statuses] == [(6, True, [other]), (3, True, [other])]
        checked = list_checkpoints(nodes / f"node{rank}", remote=nodes / "remote")
        assert [(s.step, s.valid, s.elsewhere) for s in checked] == [(6, True, []), (3, True, [])]
    code, out = _cli("verify", nodes / "node1")
    assert code == 0 and "the files of rank 0 are on other nodes: not checked" in out and "2 of 2" in out, out
    code, out = _cli("ls", nodes / "node1", "--json")
    assert code == 0 and [s["elsewhere"] for s in json.loads(out)] == [[0], [0]]


def test_the_report_of_the_node_without_rank_0_counts_its_checkpoints(nodes: Path) -> None:
    assert (
        [r.step for r in load_run(nodes / "node1").records]
        == [r.step for r in load_run(nodes / "node0").records]
        == [3, 6]
    )


def test_damage_on_either_side_still_fails(nodes: Path, tmp_path: Path) -> None:
    import shutil

    copy = Path(shutil.copytree(nodes, tmp_path / "copy"))
    (copy / "node1" / "step_000000006" / "rank00001.safetensors").unlink()
    remote_file = copy / "remote" / "step_000000003" / "rank00000.safetensors"
    raw = bytearray(remote_file.read_bytes())
    raw[-1] ^= 0xFF
    remote_file.write_bytes(bytes(raw))
    code, out = _cli("verify", copy / "node1", "--remote", copy / "remote", "--no-set-aside")  # reported, kept
    assert code == 1, out
    assert "FAILED step_000000006: none of its data files is in this directory" in out, out
    assert "FAILED step_000000003" in out and "checksum" in out, out
    (copy / "remote" / "step_000000003" / "rank00000.safetensors").unlink()
    quick = list_checkpoints(copy / "node1", checksums=False, remote=copy / "remote")
    assert quick[1].reason == f"data file rank00000.safetensors in {copy / 'remote'} is missing"


def test_export_of_a_checkpoint_written_by_two_ranks_gives_the_whole_model(nodes: Path, tmp_path: Path) -> None:
    """The ranks each wrote a share of the parameters (a tensor cut between their files): ``export``
    puts them together, as a one-process restore does, and takes saved rank 0's own state."""
    checkpoint = nodes / "remote" / f"step_{STEPS:09d}"  # the remote tier holds both ranks' files
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert any(len(e["parts"]) > 1 for e in manifest["distributed"]["tensors"].values())  # a tensor is cut
    code, out = _cli("export", checkpoint, "--to", tmp_path / "model.pt", "--only", "model")
    assert code == 0, out
    exported, final = torch.load(tmp_path / "model.pt", weights_only=True), torch.load(nodes / "final0.pt")
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], v) for k, v in final.items())
    code, out = _cli("export", checkpoint, "--to", tmp_path / "state.safetensors")
    assert code == 0 and "(11 tensors)" in out, out


def test_verify_fails_a_checkpoint_whose_index_does_not_put_its_tensors_together(nodes: Path, tmp_path: Path) -> None:
    """Every file matches its checksum, but the manifest gives a cut tensor a shape its pieces do not
    cover: ``restore()`` skips such a checkpoint, so ``verify`` fails it, and ``diff`` names the side."""
    import shutil

    good = nodes / "remote" / f"step_{STEPS:09d}"
    run = tmp_path / "run"
    bad = Path(shutil.copytree(good, run / good.name))
    manifest = json.loads((bad / "manifest.json").read_text())
    name = next(n for n, e in manifest["distributed"]["tensors"].items() if len(e["parts"]) > 1)
    manifest["distributed"]["tensors"][name]["shape"][0] += 1
    (bad / "manifest.json").write_bytes(seal_manifest(manifest))  # sealed again: refused for its index
    code, out = _cli("verify", run, "--no-set-aside")  # kept in place for the diff below
    assert code == 1 and f"FAILED {good.name}: manifest's distributed index is malformed" in out, out
    code, out = _cli("diff", good, bad)
    assert code == 2 and f"checkpoint B ({bad})" in out, out
