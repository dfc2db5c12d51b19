"""What grows with the number of ranks: the manifest (real gloo ranks), the limits that keep a
checkpoint readable, and how the ranks learn who shares a directory."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import checkfreq.ranks.compat
import checkfreq.ranks.group_cluster
import checkfreq.storage.format
from checkfreq import Checkpointer, Every
from checkfreq.errors import CheckfreqError, CorruptCheckpointError, PersistError
from checkfreq.pipeline.restore import read_checkpoint
from checkfreq.ranks import replicas, sharing
from checkfreq.ranks.collectives import GroupPeers
from checkfreq.ranks.rebuild import chunk_holders, complete
from checkfreq.storage import LocalStore
from checkfreq.storage.format import (
    DTYPES_BY_CODE,
    MANIFEST_CHECKSUM_KEY,
    MANIFEST_NAME,
    RANK_RECORD_KEY,
    SCHEMA_VERSION,
    Manifest,
)
from checkfreq.tools.diff import diff
from helpers import ROOT, make_model, spawn_ranks, train_step

sys.path.insert(0, str(ROOT))

from benchmarks.protocol_sim import CountingPeers, simulate  # noqa: E402

LAYERS = 18
"""18 linear layers and AdamW: 36 parameters and 108 optimizer state tensors."""


def _rank(rank: int, world: int, store_path: str, directory: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(LAYERS)])
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters())
    ckpt = Checkpointer(directory, policy=1000, model=model, optimizer=optimizer)
    ckpt["rank"] = rank
    for _ in range(2):
        ddp(torch.randn(4, 32)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        ckpt.step()
    ckpt.save(blocking=True)
    ckpt.close()
    torch.save(model.state_dict(), f"{directory}.final{rank}.pt")
    dist.destroy_process_group()


def _save(tmp_path: Path, world: int) -> Path:
    """The checkpoint a DDP job of ``world`` ranks saves at step 2."""
    spawn_ranks(_rank, (world, str(tmp_path / f"store{world}"), str(tmp_path / f"ckpt{world}")), world)
    return tmp_path / f"ckpt{world}" / "step_000000002"


def test_the_manifest_grows_by_a_file_entry_per_rank_and_each_rank_keeps_its_own_part(tmp_path: Path) -> None:
    """About 150 tensors saved by 1, 2 and 4 DDP ranks: manifest.json grows by less than 250 bytes per
    added rank (each rank's file, and the few tensors a cut splits); each rank's skeleton and its own
    tensors are in its file and come back."""
    checkpoints = {world: _save(tmp_path, world) for world in (1, 2, 4)}
    sizes = {world: (path / MANIFEST_NAME).stat().st_size for world, path in checkpoints.items()}
    assert (sizes[2] - sizes[1]) < 250 and (sizes[4] - sizes[2]) < 2 * 250, sizes
    doc = json.loads((checkpoints[4] / MANIFEST_NAME).read_bytes())
    assert doc["schema_version"] == SCHEMA_VERSION and doc["tensors"] == {} and doc["state"] is None
    assert len(doc["distributed"]["tensors"]) == 4 * LAYERS * 2  # parameters, exp_avg, exp_avg_sq, step
    manifest, tensors = read_checkpoint(checkpoints[4])
    assert [skeleton["rank"] for skeleton in manifest.distributed["ranks"]] == [0, 1, 2, 3]
    assert len(tensors) > len(doc["distributed"]["tensors"])  # every rank's generators too


def test_a_rank_file_without_its_record_is_refused() -> None:
    manifest = Manifest(
        step=1,
        epoch=None,
        world_size=1,
        files={"rank00000.safetensors": {"size": 10, "xxh3_64": "0"}},
        tensors={},
        state=None,
        versions={},
        created=0.0,
        distributed={"tensors": {}},
    )
    with pytest.raises(CorruptCheckpointError, match=f"lacks its rank's record .__metadata__.{RANK_RECORD_KEY}"):
        complete(manifest, {"rank00000.safetensors": {}})
    with pytest.raises(CorruptCheckpointError, match="manifest of 2 ranks lists the files"):
        complete(Manifest(**{**manifest.__dict__, "world_size": 2}), {"rank00000.safetensors": {}})


def test_a_manifest_a_reader_would_refuse_fails_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint whose manifest exceeds the reader's cap is not committed: the save says why."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(tmp_path, policy=1000, model=model, optimizer=optimizer)
    train_step(model, optimizer)
    ckpt.step()
    monkeypatch.setattr(checkfreq.storage.format, "MAX_MANIFEST_BYTES", 1000)
    with pytest.raises(PersistError, match="manifest.json would be .* bytes, over the 1000 bytes a reader accepts"):
        ckpt.save(blocking=True)
    ckpt.close()
    assert not list(tmp_path.glob("step_*"))


def test_a_schema_version_1_checkpoint_is_still_restored(tmp_path: Path) -> None:
    """Version 1 wrote the same manifest for one process (version 2 moved only per-rank parts)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(tmp_path, policy=1000, model=model, optimizer=optimizer)
    train_step(model, optimizer)
    ckpt.step()
    ckpt.save(blocking=True)
    ckpt.close()
    path = tmp_path / "step_000000001" / MANIFEST_NAME
    doc = json.loads(path.read_bytes())  # as version 1 wrote it: no checksum of its own
    del doc[MANIFEST_CHECKSUM_KEY]
    path.write_text(json.dumps({**doc, "schema_version": 1}, indent=1))
    fresh = make_model(seed=1)
    restored = Checkpointer(tmp_path, policy=1000, model=fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1))
    assert restored.restore() == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True))
    restored.close()


def _leaders(rank: int, root: str, directories: list[str], forged: bool, out: str) -> None:
    """Rank ``rank`` learns its directory's leader; with ``forged``, rank 1 names its (shared)
    directory by an identity of its own, as a file system seen differently by two machines would."""
    dist.init_process_group(
        "gloo", store=dist.FileStore(f"{root}/store", len(directories)), rank=rank, world_size=len(directories)
    )
    if forged and rank == 1:
        sharing.directory_key = lambda path: "nfs4:forged"  # type: ignore[assignment]
    try:
        answer: object = sharing.directory_leader(LocalStore(directories[rank]), "t0k3n", GroupPeers(dist.group.WORLD))
    except CheckfreqError as e:
        answer = str(e)
    Path(out, f"rank{rank}.json").write_text(json.dumps(answer))
    dist.destroy_process_group()


def _run_leaders(tmp_path: Path, names: list[str], forged: bool = False) -> list[object]:
    directories = [str(tmp_path / name) for name in names]
    spawn_ranks(_leaders, (str(tmp_path), directories, forged, str(tmp_path)), len(names))
    assert not [p for p in tmp_path.rglob(".checkfreq-probe-*")]  # every probe is removed
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(len(names))]


def test_ranks_sharing_a_directory_follow_its_lowest_rank(tmp_path: Path) -> None:
    """Three ranks, two "nodes": ranks 0 and 2 share a directory (through a symbolic link too)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "a")
    assert _run_leaders(tmp_path, ["a", "b", "link"]) == [0, 1, 0]


def test_an_identity_that_splits_a_shared_directory_is_refused_on_every_rank(tmp_path: Path) -> None:
    answers = _run_leaders(tmp_path, ["a", "a"], forged=True)
    assert all("the ranks disagree on who shares a checkpoint directory" in str(a) for a in answers), answers
    assert "rank 0 sees the directory of ranks [1], whose identity differs" in str(answers[0])


def test_sharded_tensors_the_ranks_disagree_on_are_named() -> None:
    same = {"model/w": {"dtype": "F32", "shape": [8, 4]}}
    assert replicas.sharded_disagreement([same, same]) is None
    message = replicas.sharded_disagreement([same, {"model/w": {"dtype": "F32", "shape": [8, 2]}}])
    assert message is not None and "'model/w' is F32 (8, 4) on ranks [0] but F32 (8, 2) on ranks [1]" in message
    message = replicas.sharded_disagreement([same, {"model/w": {**same["model/w"], "chunked": 0}}])
    assert message is not None and (
        "'model/w' is F32 (8, 4) on ranks [0] but F32 (8, 4) chunked along dim 0 on ranks [1]" in message
    )


@pytest.mark.parametrize(
    "record",
    [
        {"state": None, "tensors": {"x": "y"}},
        {"state": None, "tensors": {"x": {"kind": "sharded", "parts": [["a", [0]]]}}},
        {"state": None, "tensors": {"x": {"kind": "private", "parts": [1, 2]}}},
    ],
)
@pytest.mark.parametrize("shared", [{}, [], {"x": {"kind": "replicated", "parts": []}}])
def test_malformed_rank_records_are_corrupt_checkpoints(record: dict, shared: object) -> None:
    header = {"__metadata__": {RANK_RECORD_KEY: json.dumps(record)}}
    manifest = Manifest(
        step=1,
        epoch=None,
        world_size=1,
        files={"rank00000.safetensors": {"size": 10, "xxh3_64": "0"}},
        tensors={},
        state=None,
        versions={},
        created=0.0,
        distributed={"tensors": shared},
    )
    with pytest.raises(CorruptCheckpointError):
        complete(manifest, {"rank00000.safetensors": header})


class _CountingPeers(CountingPeers):
    """A real gloo group whose messages this rank counts, as the protocol simulator counts its ranks'."""

    def __init__(self, group: object, *options: object) -> None:
        super().__init__(GroupPeers(group, *options))  # GroupCluster passes its liveness and the activity


def _counted_rank(rank: int, world: int, store_path: str, directories: list[str], out: str) -> None:
    checkfreq.ranks.group_cluster.GroupPeers = _CountingPeers  # type: ignore[misc] - counts, the messages still go over gloo
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    torch.manual_seed(0)
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters())
    ckpt = Checkpointer(directories[rank], policy=1000, model=model, optimizer=optimizer)
    peers = ckpt._cluster.commit
    for _ in range(3):
        train_step(ddp, optimizer)
        ckpt.step()
        ckpt.save(blocking=True)
    ckpt.close()
    counted = peers.ledger.now
    counts = {"sent": counted.bytes_out / 3, "received": counted.bytes_in / 3, "all_gathers": counted.all_gathers}
    Path(out, f"rank{rank}.json").write_text(json.dumps(counts))
    dist.destroy_process_group()


def _commit_bytes(tmp_path: Path, world: int, node_local: bool) -> list[dict]:
    out = tmp_path / f"{world}-{node_local}"
    out.mkdir()
    directories = [str(out / (f"node{r // 2}" if node_local else "shared")) for r in range(world)]
    spawn_ranks(_counted_rank, (world, str(out / "store"), directories, str(out)), world)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_a_commit_costs_each_rank_but_rank_0_the_same_bytes_at_any_world_size(tmp_path: Path) -> None:
    """Real DDP ranks, three checkpoints: a rank other than 0 sends its report to rank 0 and hears the
    verdict, the same few hundred bytes at 2 and 4 ranks; rank 0 receives one report per rank; no
    all-gather. With a directory per node (ranks 0-1 and 2-3), rank 2 leads its node's directory and
    also receives the reports, to write the same manifest, and every rank hears which checkpoints the
    leaders found damaged when they read them back (a few bytes). The protocol simulator's 4 ranks count the
    same bytes (but for the digits of the file sizes in the reports)."""
    two, four = _commit_bytes(tmp_path, 2, False), _commit_bytes(tmp_path, 4, False)
    simulated = simulate(4, layers=LAYERS, restore_up_to=0, directory=str(tmp_path)).counts("commit")
    for rank in range(4):
        assert simulated[rank].all_gathers == 0
        assert simulated[rank].bytes_in == pytest.approx(four[rank]["received"], abs=8 * 3), (
            rank,
            simulated[rank],
            four[rank],
        )
        assert simulated[rank].bytes_out == pytest.approx(four[rank]["sent"], abs=8), (
            rank,
            simulated[rank],
            four[rank],
        )
    assert all(c["all_gathers"] == 0 for c in two + four)
    for counts in (two[1], four[1], four[2], four[3]):
        assert counts["sent"] < 400 and counts["received"] < 100, counts
        assert abs(counts["sent"] - two[1]["sent"]) <= 8 and counts["received"] == two[1]["received"], (counts, two[1])
    assert 3 * 150 < four[0]["received"] < 3 * 400, four[0]
    nodes = _commit_bytes(tmp_path, 4, True)
    assert nodes[1]["received"] == nodes[3]["received"]
    # and the steps the leaders found damaged when they read back, broadcast once per commit: none here
    assert 0 < nodes[1]["received"] - two[1]["received"] <= 3 * 16, (nodes[1], two[1])
    assert nodes[2]["received"] > four[0]["received"] > nodes[1]["received"], nodes


def _count_restore_io(network_fs: bool) -> dict[str, Any]:
    """Count, from now on in this process, the data files read from storage (and verified), those
    mapped after another rank verified them, the bytes received from other ranks point to point and
    those the other ranks all-gathered to it. ``network_fs``: directories are taken for ones on a
    network file system (no page cache shared between the ranks), as on NFS or Lustre."""
    counts: dict[str, Any] = {"reads": [], "mapped": [], "received": 0, "gathered": 0}
    read, map_data, receive = LocalStore.read_data, LocalStore.map_data, GroupPeers.receive
    all_gather_rows = GroupPeers.all_gather_rows

    def counted_read(store: LocalStore, location: Path, name: str, size: int, checksum: str) -> tuple:
        counts["reads"].append([name, size])
        return read(store, location, name, size, checksum)

    def counted_map(store: LocalStore, location: Path, name: str, size: int, checksum: str) -> tuple:
        counts["mapped"].append(name)
        return map_data(store, location, name, size, checksum)

    def counted_receive(peers: GroupPeers, size: int, sender: int) -> torch.Tensor:
        counts["received"] += size
        return receive(peers, size, sender)

    def counted_all_gather(peers: GroupPeers, row: torch.Tensor) -> torch.Tensor:
        rows = all_gather_rows(peers, row)
        counts["gathered"] += row.numel() * (peers.size - 1)
        return rows

    # counted: the files are still read, verified and mapped, the messages still received
    LocalStore.read_data, LocalStore.map_data = counted_read, counted_map  # type: ignore[method-assign]
    GroupPeers.receive, GroupPeers.all_gather_rows = counted_receive, counted_all_gather  # type: ignore[method-assign]
    if network_fs:
        checkfreq.ranks.group_cluster.on_machine_local_file_system = lambda path: False
    return counts


def _restore_counted(rank: int, world: int, store_path: str, directory: str, network_fs: bool) -> None:
    """Restore ``directory`` and write down what it read, mapped and received (:func:`_count_restore_io`)
    and its state."""
    counts = _count_restore_io(network_fs)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(LAYERS)])
    optimizer = torch.optim.AdamW(model.parameters())
    ckpt = Checkpointer(directory, policy=1000, model=model, optimizer=optimizer)
    ckpt["rank"] = -1
    counts["received"] = 0  # what start-up received (each rank its directory's leader) is not the restore's
    assert ckpt.restore() == 2
    torch.save({**counts, "model": model.state_dict(), "rank": ckpt["rank"]}, f"{directory}.restored{rank}.pt")
    ckpt.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("network_fs", [False, True], ids=["machine-local-fs", "network-fs"])
def test_each_rank_reads_its_share_of_a_shared_directory(tmp_path: Path, network_fs: bool) -> None:
    """Four DDP ranks restore from the one directory they saved to: each rank reads (and verifies)
    one data file from storage, its own (its quarter of the replicated tensors and its private
    ones). On a machine-local file system the ranks share a page cache: each maps the three other
    files, which their readers verified, and receives only rank 0's orders; on a network file
    system each gets the other ranks' quarters of the replicated tensors, all-gathered, and none of
    their headers or private tensors. Every rank restores the saved state."""
    path = _save(tmp_path, 4)
    manifest = json.loads((path / MANIFEST_NAME).read_bytes())
    sizes = manifest["files"]
    replicated = sum(
        math.prod(e["shape"]) * DTYPES_BY_CODE[e["dtype"]].itemsize
        for e in manifest["distributed"]["tensors"].values()
        if e["kind"] == "replicated"
    )
    directory = str(tmp_path / "ckpt4")
    spawn_ranks(_restore_counted, (4, str(tmp_path / "store-restore"), directory, network_fs), 4)
    saved = torch.load(f"{directory}.final0.pt")
    total = sum(entry["size"] for entry in sizes.values())
    for rank in range(4):
        restored = torch.load(f"{directory}.restored{rank}.pt")
        name = f"rank{rank:05d}.safetensors"
        others = sorted(set(sizes) - {name})
        assert restored["reads"] == [[name, sizes[name]["size"]]], restored["reads"]
        assert sizes[name]["size"] < 0.3 * total
        assert restored["received"] < 1000, restored["received"]  # rank 0's orders: no file is sent whole
        if network_fs:  # three quarters of the replicated bytes (each quarter within 1/16), a few ints, no header
            assert restored["mapped"] == [], restored["mapped"]
            assert 0.7 * replicated < restored["gathered"] < 0.8 * replicated + 2000, (restored["gathered"], replicated)
            assert restored["gathered"] < sum(sizes[n]["size"] for n in others)
        else:
            assert sorted(restored["mapped"]) == others and restored["gathered"] == 0, restored
        assert restored["rank"] == rank
        assert all(torch.equal(restored["model"][k], v) for k, v in saved.items())


def _fsdp_model(seed: int, sharded: bool = True) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Three linear layers, 37 rows each (uneven shards over 4 ranks), each ``fully_shard``-ed
    (with ``sharded``), and Adam."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 37), torch.nn.Linear(37, 37), torch.nn.Linear(37, 37))
    if sharded:
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _fsdp_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Every tensor gathered to its global value, and the model's local shards."""
    state = {f"model/{k}": _full(v) for k, v in model.state_dict().items()}
    state.update(
        {f"optimizer/{i}/{k}": _full(v) for i, s in optimizer.state_dict()["state"].items() for k, v in s.items()}
    )
    return {"state": state, "local": {k: v.to_local() for k, v in model.state_dict().items() if hasattr(v, "to_local")}}


def _fsdp_rank(rank: int, world: int, root: str) -> None:
    """Train an FSDP2 model two steps and checkpoint it; then restore it on a network file system,
    counted (:func:`_count_restore_io`), into the same layout ("same") and into whole, unsharded
    models on every rank ("plain"). Write down each phase's state and counts."""
    counts = _count_restore_io(network_fs=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{root}/store", world), rank=rank, world_size=world)
    model, optimizer = _fsdp_model(seed=0)
    with Checkpointer(f"{root}/ckpt", policy=1000, model=model, optimizer=optimizer) as ckpt:
        for step in range(2):
            generator = torch.Generator().manual_seed(10 * step + rank)
            model(torch.randn(5, 8, generator=generator)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            ckpt.step()
        ckpt.save(blocking=True)
    out = {"save": _fsdp_state(model, optimizer)}
    for phase in ("same", "plain"):
        model, optimizer = _fsdp_model(seed=1, sharded=phase == "same")
        with Checkpointer(f"{root}/ckpt", policy=1000, model=model, optimizer=optimizer) as ckpt:
            counts.update(reads=[], mapped=[], received=0, gathered=0)  # the restore's, not the start-up's
            assert ckpt.restore() == 2
            out[phase] = {**counts, **_fsdp_state(model, optimizer)}
    torch.save(out, f"{root}/rank{rank}.pt")
    dist.destroy_process_group()


def _fsdp_resharded(rank: int, world: int, root: str) -> None:
    """Restore the four ranks' FSDP2 checkpoint on ``world`` ranks, counted; write down the state."""
    counts = _count_restore_io(network_fs=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{root}/store{world}", world), rank=rank, world_size=world)
    model, optimizer = _fsdp_model(seed=1)
    with Checkpointer(f"{root}/ckpt", policy=1000, model=model, optimizer=optimizer) as ckpt:
        counts.update(reads=[], mapped=[], received=0, gathered=0)
        assert ckpt.restore() == 2
    torch.save({**counts, **_fsdp_state(model, optimizer)}, f"{root}/resharded{rank}.pt")
    with Checkpointer(f"{root}/ckpt{world}", policy=1000, model=model, optimizer=optimizer) as ckpt:
        ckpt.start_at(2)
        ckpt.save(blocking=True)  # the same state, written by ``world`` ranks
    dist.destroy_process_group()


def test_fsdp2_ranks_get_the_files_holding_their_blocks(tmp_path: Path) -> None:
    """Four FSDP2 ranks on a network file system restore their checkpoint at the same layout: each
    reads (and verifies) its own data file only, which holds its shards, and receives no other
    rank's file. Four ranks with whole, unsharded models restore it too: their own files do not
    cover their blocks (the whole tensors), so the ranks take the step again, each getting every
    file. Two FSDP2 ranks restore it: rank 0's rows (0-18 of 37) lie in saved ranks 0 and 1's
    files, rank 1's (19-36) in 1, 2 and 3's; the files are read in turns (0 and 2 by rank 0, 1
    and 3 by rank 1), so each receives one file, not two. Every restore ends with the saved state,
    bit for bit."""
    world = 4
    spawn_ranks(_fsdp_rank, (world, str(tmp_path)), world)
    spawn_ranks(_fsdp_resharded, (2, str(tmp_path)), 2)
    manifest = json.loads((tmp_path / "ckpt" / "step_000000002" / MANIFEST_NAME).read_bytes())
    sizes, saved_tensors = manifest["files"], manifest["distributed"]["tensors"].values()
    layouts = [e.get("chunked") for e in saved_tensors if e["kind"] == "sharded"]
    # 6 parameters and Adam's two moments: rows chunked over the ranks
    assert len(layouts) == 18 and set(layouts) == {0}
    for rank, (reads, received) in enumerate(
        [
            (["rank00000.safetensors", "rank00002.safetensors"], "rank00001.safetensors"),
            (["rank00001.safetensors", "rank00003.safetensors"], "rank00002.safetensors"),
        ]
    ):
        resharded = torch.load(tmp_path / f"resharded{rank}.pt")
        assert [name for name, _ in resharded["reads"]] == reads, resharded["reads"]
        assert 0.9 * sizes[received]["size"] < resharded["received"] < 1.1 * sizes[received]["size"], (resharded, sizes)
    for rank in range(world):
        name = f"rank{rank:05d}.safetensors"
        out = torch.load(tmp_path / f"rank{rank}.pt")
        saved, same, plain = out["save"], out["same"], out["plain"]
        assert same["reads"] == [[name, sizes[name]["size"]]] and same["mapped"] == [], same["reads"]
        assert same["received"] < 1000 and same["gathered"] < 100, same  # rank 0's orders; Adam's steps (replicated)
        assert saved["local"].keys() == same["local"].keys()
        for key, shard in saved["local"].items():
            assert torch.equal(same["local"][key], shard), key
        assert plain["reads"][0] == [name, sizes[name]["size"]], plain["reads"]  # the first try, its own file
        others = sum(size["size"] for n, size in sizes.items() if n not in {r for r, _ in plain["reads"]})
        assert plain["received"] > 0.8 * others, plain  # then every file: read, or received from its reader
        restores = [same, plain] + ([torch.load(tmp_path / f"resharded{rank}.pt")] if rank < 2 else [])
        for restored in restores:
            assert restored["state"].keys() == saved["state"].keys()
            for key, value in saved["state"].items():
                assert torch.equal(restored["state"][key], value), key
    # ``checkfreq diff`` compares the parameters and optimizer state whole, whatever the world size
    compared = diff(tmp_path / "ckpt" / "step_000000002", tmp_path / "ckpt2" / "step_000000002").tensors
    shared = {row.name: row.status for row in compared if not row.name.startswith("rng/")}
    assert shared.keys() == {k.replace("optimizer/", "optimizer/state/") for k in saved["state"]}
    assert set(shared.values()) == {"equal"}, shared


def _chunks(size: int, parts: int) -> list[tuple[int, int]]:
    """(first row, rows) of each of ``parts`` blocks as ``torch.chunk`` cuts ``size`` rows (and the
    empty blocks it leaves out at the end, as DTensor's ``Shard`` gives them)."""
    blocks = [(int(c[0]), len(c)) for c in torch.arange(size).chunk(parts)] if size else []
    return blocks + [(size, 0)] * (parts - len(blocks))


def test_the_files_a_block_needs_are_those_whose_chunks_it_meets() -> None:
    """At any saved and restoring world size, a rank's block of a ``Shard(0)`` tensor is met by the
    saved ranks' blocks that ``chunk_holders`` names: no more, no fewer."""
    for size in range(0, 41):
        for saved in range(1, 8):
            held = _chunks(size, saved)
            for now in range(1, 8):
                for begin, rows in _chunks(size, now):
                    box = ((begin, 0), (rows, 3))
                    meets = [k for k, (b, n) in enumerate(held) if n and rows and b < begin + rows and begin < b + n]
                    assert list(chunk_holders((size, 3), 0, saved, box)) == meets, (size, saved, now, box)


def _established_connections() -> int:
    """This process's TCP connections in the ESTABLISHED state (its sockets found in /proc/net/tcp*)."""
    sockets = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            sockets.add(target[len("socket:[") : -1])
    established = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as rows:
            next(rows)
            established += sum(1 for row in rows if row.split()[3] == "01" and row.split()[9] in sockets)
    return established


def _connections_rank(rank: int, world: int, store_path: str, directory: str, out: str, lazy: bool) -> None:
    if not lazy:  # as with torch 2.6 and 2.7, which cannot connect gloo pairs on demand
        checkfreq.ranks.compat.lazy_gloo_backend = lambda: None
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters())
    train_step(ddp, optimizer)
    before = _established_connections()  # the default group's: a full mesh (a FileStore opens none)
    ckpt = Checkpointer(directory, policy=Every(seconds=3600), model=model, optimizer=optimizer)
    votes = 0
    for step in range(12):
        train_step(ddp, optimizer)
        ckpt.step()
        votes += ckpt._cluster._decider._calls == ckpt._cluster._decider._next_vote
        if step % 4 == 3:
            ckpt.save(blocking=True)
    ckpt.close()
    counts = {"default": before, "checkfreq": _established_connections() - before, "votes": votes}
    Path(out, f"rank{rank}.json").write_text(json.dumps(counts))
    dist.barrier()  # a rank that left first would close its sockets while another counts them
    dist.destroy_process_group()


@pytest.mark.parametrize("lazy", [True, False], ids=["on first message", "every pair at creation"])
def test_a_rank_connects_only_to_the_ranks_it_talks_to(tmp_path: Path, lazy: bool) -> None:
    """5 DDP ranks (gloo, a FileStore: the default group's full mesh is every TCP connection a rank
    has before the Checkpointer, 4 each), a time-based policy (control, commit and vote groups), 3
    checkpoints and the votes of 12 steps. Connected on first message, checkfreq's groups held, on
    the 2-core test VM: rank 0 11 connections (every rank's commit report and vote come to it), the
    other ranks 4 to 6. Where torch cannot connect on demand, every rank holds three full meshes: 12."""
    world = 5
    args = (world, str(tmp_path / "store"), str(tmp_path / "ckpt"), str(tmp_path), lazy)
    spawn_ranks(_connections_rank, args, world)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    full_mesh = 3 * (world - 1)
    assert all(r["default"] == world - 1 and r["votes"] >= 2 for r in ranks), ranks  # the count sees a full mesh
    if lazy:
        assert all(0 < r["checkfreq"] < full_mesh for r in ranks[1:]), ranks
        assert ranks[0]["checkfreq"] <= full_mesh, ranks
    else:
        assert all(r["checkfreq"] == full_mesh for r in ranks), ranks
