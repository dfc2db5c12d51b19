"""What checkfreq.ranks.replicas says when ranks disagree, and which ranks share a local directory
(checkfreq.ranks.sharing) over an in-process world (fake_peers.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from fake_peers import FakePeers, run_ranks

import checkfreq.ranks.sharing as sharing
from checkfreq.errors import CheckfreqError
from checkfreq.ranks.collectives import Solo
from checkfreq.ranks.replicas import SHOWN, disagreement, fingerprint, report, sharded_disagreement
from checkfreq.storage.local import LocalStore

LAYOUT = (("model/w", "F32", (4, 3)), ("model/b", "F32", (3,)), ("opt/state/0/exp_avg", "F32", (4, 3)))


def _reports(changes: dict[int, dict[str, str]], ranks: int = 4) -> list[dict]:
    """Every rank's report of LAYOUT, rank ``r``'s fingerprints changed by ``changes[r]``."""
    prints = {name: f"print-{name}" for name, _, _ in LAYOUT}
    return [report(LAYOUT, {**prints, **changes.get(rank, {})}) for rank in range(ranks)]


def test_agreeing_ranks_have_no_disagreement() -> None:
    assert disagreement(_reports({})) is None
    assert sharded_disagreement([{"w": {"dtype": "F32", "shape": [4, 3]}}] * 3) is None


def test_differing_values_name_the_entry_and_the_ranks() -> None:
    message = disagreement(_reports({2: {"model/b": "other"}, 3: {"model/b": "third"}}))
    assert message is not None
    assert "'model/b' holds 3 different values, on ranks [0, 1] and [2] and [3]" in message
    assert "model/w" not in message and "exp_avg" not in message


def test_a_differing_layout_is_named_before_values() -> None:
    reports = _reports({1: {"model/w": "other"}})
    reports[1]["layout"][0][2] = [3, 4]  # model/w is 3 x 4 on rank 1
    del reports[2]["layout"][1]  # rank 2 has no model/b
    message = disagreement(reports)
    assert message is not None
    assert "'model/b' is F32 (3,) on ranks [0, 1, 3] but absent on ranks [2]" in message
    assert "'model/w' is F32 (4, 3) on ranks [0, 2, 3] but F32 (3, 4) on ranks [1]" in message
    assert "different values" not in message


def test_many_disagreements_are_counted_past_the_shown_ones() -> None:
    names = [f"t{i:02d}" for i in range(SHOWN + 3)]
    layout = tuple((name, "F32", (1,)) for name in names)
    message = disagreement([report(layout, {n: "a" for n in names}), report(layout, {n: "b" for n in names})])
    assert message is not None
    assert all(f"'{name}'" in message for name in names[:SHOWN])
    assert f"'{names[SHOWN]}'" not in message and "and 3 more" in message


def test_sharded_disagreement_names_dtype_shape_and_layout() -> None:
    per_rank = [
        {"w": {"dtype": "F32", "shape": [4, 3], "chunked": 0}},
        {"w": {"dtype": "F32", "shape": [4, 3], "chunked": 1}},
        {"w": {"dtype": "BF16", "shape": [4, 3], "chunked": 0}},
    ]
    message = sharded_disagreement(per_rank)
    assert message is not None
    assert "F32 (4, 3) chunked along dim 0 on ranks [0]" in message
    assert "F32 (4, 3) chunked along dim 1 on ranks [1]" in message and "BF16 (4, 3)" in message


def test_fingerprint_is_of_the_bytes() -> None:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert fingerprint(x) == fingerprint(x.clone()) == fingerprint(x.t().contiguous().t())
    assert fingerprint(x) != fingerprint(x.to(torch.float64))
    y = x.clone()
    y[2, 3] += 1
    assert fingerprint(x) != fingerprint(y)


def test_a_world_of_one_leads_its_directory(tmp_path: Path) -> None:
    assert sharing.directory_leader(LocalStore(tmp_path / "a"), "tok", Solo()) == 0
    assert not list((tmp_path / "a").iterdir())  # the probe is gone


def test_ranks_sharing_a_directory_follow_its_lowest_rank(tmp_path: Path) -> None:
    dirs = [tmp_path / "a", tmp_path / "a", tmp_path / "b", tmp_path / "a", tmp_path / "c"]

    def leader(peers: FakePeers) -> int:
        return sharing.directory_leader(LocalStore(dirs[peers.rank]), "tok", peers)

    leaders, wire = run_ranks(len(dirs), leader)
    assert leaders == [0, 0, 2, 0, 4]
    assert all(not list(d.iterdir()) for d in set(dirs))  # every probe removed
    assert max(wire.received[rank] for rank in range(1, len(dirs))) <= 6  # a few messages, whatever the size


def test_an_identity_that_lies_is_caught_on_every_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two directories with one identity (a network file system seen differently): every rank refuses."""
    monkeypatch.setattr(sharing, "directory_key", lambda path: "nfs:1:/same")
    dirs = [tmp_path / "x", tmp_path / "y", tmp_path / "x"]

    def leader(peers: FakePeers) -> str:
        try:
            sharing.directory_leader(LocalStore(dirs[peers.rank]), "tok", peers)
        except CheckfreqError as e:
            return str(e)
        return "no error"

    messages, _ = run_ranks(len(dirs), leader)
    assert len(set(messages)) == 1, messages
    assert re.search(r"rank 1 does not see the directory of rank 0", messages[0]), messages[0]
