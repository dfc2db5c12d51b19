"""The tiers behind one interface: the ordered list's questions, the null hooks, the rule that nothing
outside the tier modules tests for a tier, and the example tier of docs/architecture.md run as written."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import checkfreq as cf
import checkfreq.checkpointer
from checkfreq.pipeline.tier import SnapshotRequest, Tier, TierName
from checkfreq.pipeline.tiers import LocalTier, Tiers, choose_tiers
from checkfreq.run.events import read_events
from checkfreq.storage.local import LocalStore
from helpers import DOCS, assert_state_equal, docs_example, make_model, train_step

SRC = Path(__file__).resolve().parents[3] / "src" / "checkfreq"
TIER_MODULES = {"pipeline/tier.py", "pipeline/tiers.py", "pipeline/memory_tier.py", "pipeline/upload.py"}


class Recording(Tier):
    """A tier that records the order in which it wraps the persist, and offers a target if asked."""

    def __init__(self, name: str, calls: list[str], target: Any = None) -> None:
        self.name, self.calls, self._target = name, calls, target

    def target(self, request: SnapshotRequest) -> Any:
        return self._target

    def around_persist(self, target: Any, pending: Any, persist: Any) -> Any:
        def job() -> Any:
            self.calls.append(f"{self.name} sees {target}")
            return persist()

        return job


def test_the_tiers_wrap_a_persist_fastest_outermost_and_each_sees_only_its_own_target(tmp_path: Path) -> None:
    calls: list[str] = []
    fast, slow = Recording("fast", calls, target="slot"), Recording("slow", calls, target="other")
    tiers = Tiers([fast, LocalTier(LocalStore(tmp_path)), slow])
    placement = tiers.place(None)  # type: ignore[arg-type]
    assert placement is not None and placement.tier is fast  # the first tier that offers a target
    job = tiers.around_persist(placement, None, lambda: calls.append("persist") or "done")  # type: ignore[arg-type]
    assert job() == "done"
    assert calls == ["fast sees slot", "slow sees None", "persist"]
    assert tiers.committed_to.name == TierName.LOCAL and tiers.far == [] and tiers.followers == []


def test_a_bare_tier_is_a_complete_null_object(tmp_path: Path) -> None:
    tier = Tier()
    assert not tier.busy and not tier.due(5, 0.1) and tier.ready
    assert tier.target(None) is None  # type: ignore[arg-type]
    assert tier.wait(1.0) is None and tier.take_error() is None and tier.unpersisted(-1) is None
    assert tier.checkpoints() == [] and tier.snapshots() == ([], []) and tier.newest_step() is None
    persist = object()
    assert tier.around_persist(None, None, persist) is persist  # type: ignore[arg-type]
    for hook in (tier.follow, tier.taken, tier.forget_newer_than):
        hook(3)
    tier.flush(3, 1.0), tier.stop(1.0), tier.record_cost(0.1), tier.record_device_wait(0.1), tier.release()
    tier.close(remove=True)
    with pytest.raises(NotImplementedError, match="no snapshots of its own"):
        tier.submit(None, None, None, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="need one with a store"):
        Tiers([Tier()])


def test_tier_names_are_an_enum_that_reads_and_travels_as_its_value() -> None:
    assert {str(name) for name in TierName} == {"memory", "local", "remote"}
    assert json.loads(json.dumps({"tier": TierName.REMOTE})) == {"tier": "remote"}
    assert TierName.LOCAL == "local" and {"local": 1}[TierName.LOCAL] == 1


def _tier_classes() -> set[str]:
    return {name for name in dir(checkfreq.pipeline.tiers) if name.endswith("Tier")} | {
        "MemoryTier",
        "RemoteTier",
        "Tier",
        "LocalTier",
        "Tiers",
    }


def test_nothing_outside_the_tier_modules_tests_for_a_particular_tier() -> None:
    """No ``isinstance(x, SomeTier)`` and no ``... is None`` on a tier: each hook answers for itself."""
    classes = _tier_classes()
    offenders = []
    for path in SRC.rglob("*.py"):
        relative = path.relative_to(SRC).as_posix()
        if relative in TIER_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                names = {n.id for arg in node.args[1:] for n in ast.walk(arg) if isinstance(n, ast.Name)}
                if names & classes:
                    offenders.append(f"{relative}:{node.lineno}")
            if isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value is None for c in node.comparators
            ):
                text = ast.unparse(node.left)
                if any(word in text for word in ("tier", "_memory", "uploader", "_remote")):
                    offenders.append(f"{relative}:{node.lineno} {ast.unparse(node)}")
    assert not offenders, offenders


def test_the_example_tier_of_the_docs_mirrors_every_checkpoint_and_restores_what_the_directory_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    namespace: dict[str, Any] = {}
    exec(compile(docs_example(DOCS / "architecture.md", "A tier of your own"), "architecture.md", "exec"), namespace)
    mirror = tmp_path / "mirror"

    def with_mirror(local: Any, far: Any, cluster: Any, **options: Any) -> Tiers:  # the line in choose_tiers
        return Tiers([*choose_tiers(local, far, cluster, **options).all, namespace["MirrorTier"](local, mirror)])

    monkeypatch.setattr(checkfreq.checkpointer, "choose_tiers", with_mirror)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with cf.Checkpointer(tmp_path / "run", policy=2, keep=1, model=model, optimizer=opt, rng=False) as ckpt:
        for _ in range(6):
            train_step(model, opt)
            ckpt.step()
    assert sorted(p.name for p in mirror.iterdir()) == ["step_000000002", "step_000000004", "step_000000006"]
    trained = {"model": model.state_dict(), "optimizer": opt.state_dict()}

    for lost in (tmp_path / "run").glob("step_*"):  # the local directory's disk failed
        shutil.rmtree(lost)
    fresh = make_model(seed=1)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    with cf.Checkpointer(tmp_path / "run", policy=2, model=fresh, optimizer=fresh_opt, rng=False) as again:
        assert again.restore() == 6
    assert_state_equal({"model": fresh.state_dict(), "optimizer": fresh_opt.state_dict()}, trained)
    assert [e["tier"] for e in read_events(tmp_path / "run") if e["event"] == "restore"] == ["mirror"]
