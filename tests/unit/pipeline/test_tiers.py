"""The tiers and their roles: the ordered list's questions, each role's methods required when a tier is
built, the rule that nothing outside the tier modules tests for a tier, and the example tier of
docs/architecture.md run as written."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import checkfreq as cf
import checkfreq.pipeline.tiers.chosen
from checkfreq.pipeline.tiers.chosen import LocalTier, Tiers, check_own_tiers
from checkfreq.pipeline.tiers.roles import (
    CheckpointSource,
    CommitFollower,
    SnapshotRequest,
    SnapshotTaker,
    StateKeeper,
    Tier,
    TierName,
)
from checkfreq.run.events import read_events
from checkfreq.storage.local import LocalStore
from helpers import DOCS, assert_state_equal, docs_example, make_model, train_step

SRC = Path(__file__).resolve().parents[3] / "src" / "checkfreq"
TIER_MODULES = {
    "pipeline/tiers/roles.py",
    "pipeline/tiers/chosen.py",
    "pipeline/tiers/memory/tier.py",
    "pipeline/tiers/remote.py",
}


class Recording(SnapshotTaker):
    """A snapshot taker that records the order in which it wraps the persist, and offers a target if asked."""

    name = "recording"

    def __init__(self, name: str, calls: list[str], target: Any = None) -> None:
        self.name, self.calls, self._target = name, calls, target

    def target(self, request: SnapshotRequest) -> Any:
        return self._target

    def around_persist(self, target: Any, pending: Any, persist: Any) -> Any:
        def job() -> Any:
            self.calls.append(f"{self.name} sees {target}")
            return persist()

        return job

    @property
    def busy(self) -> bool:
        return False

    def due(self, step: int, iteration_time: float) -> bool:
        return False

    def share(self, tensors: Any, owned: Any, objects: Any, skeleton: Any) -> Any:
        return tensors, owned, None

    def submit(self, target: Any, pending: Any, skeleton: Any, epoch: Any) -> Any:
        raise AssertionError("takes no snapshots of its own")

    def taken(self, step: int) -> None:
        pass

    def record_cost(self, seconds: float) -> None:
        pass

    def record_device_wait(self, seconds: float) -> None:
        pass

    def wait(self, timeout: float) -> BaseException | None:
        return None

    def unpersisted(self, durable_step: int) -> Any:
        return None

    def report_to(self, write: Any) -> None:
        pass

    def close(self, *, remove: bool, timeout: float | None = None) -> None:
        pass

    def release(self) -> None:
        pass


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


@pytest.mark.parametrize("role", [SnapshotTaker, CommitFollower, CheckpointSource, StateKeeper])
def test_a_tier_missing_one_method_of_its_role_fails_when_built_and_names_it(role: type[Tier]) -> None:
    required = sorted(role.__abstractmethods__)
    assert {"close", "release"} <= set(required)
    for missing in required:
        methods = {name: (lambda self, *a, **k: None) for name in required if name != missing}
        incomplete = type(f"Partial{role.__name__}", (role,), {"name": "partial", **methods})
        with pytest.raises(TypeError, match=missing):
            incomplete()


def test_a_tier_without_a_name_is_refused_when_its_class_is_made(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="must name itself"):

        class Nameless(CheckpointSource):
            store = LocalStore(tmp_path)

            def close(self, *, remove: bool, timeout: float | None = None) -> None:
                pass

            def release(self) -> None:
                pass

    with pytest.raises(ValueError, match="need one with a store"):
        Tiers([Recording("fast", [])])


def test_the_tiers_hold_one_list_per_role_in_order(tmp_path: Path) -> None:
    fast, local = Recording("fast", []), LocalTier(LocalStore(tmp_path / "a"))
    far = LocalTier(LocalStore(tmp_path / "b"))
    tiers = Tiers([fast, local, far])
    assert tiers.takers == [fast] and tiers.followers == [] and tiers.keepers == []
    assert tiers.committed_to is local and tiers.far == [far] and not tiers.holds_states
    assert tiers.searched() == [f"local tier ({tmp_path / 'a'})", f"local tier ({tmp_path / 'b'})"]


def test_tier_names_are_an_enum_that_reads_and_travels_as_its_value() -> None:
    assert {str(name) for name in TierName} == {"memory", "local", "remote"}
    assert json.loads(json.dumps({"tier": TierName.REMOTE})) == {"tier": "remote"}
    assert TierName.LOCAL == "local" and {"local": 1}[TierName.LOCAL] == 1


def _tier_classes() -> set[str]:
    return {name for name in dir(checkfreq.pipeline.tiers.chosen) if name.endswith("Tier")} | {
        "MemoryTier",
        "RemoteTier",
        "Tier",
        "LocalTier",
        "Tiers",
    }


def test_nothing_outside_the_tier_modules_tests_for_a_particular_tier() -> None:
    """No ``isinstance(x, SomeTier)``, no ``... is None`` on a tier and no test for the memory tier's name:
    each role's methods answer for the tier, and a restored state says how it is applied."""
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
            if isinstance(node, ast.Compare) and "TierName.MEMORY" in ast.unparse(node):
                offenders.append(f"{relative}:{node.lineno} {ast.unparse(node)}")  # a found state says if it is held
            if isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value is None for c in node.comparators
            ):
                text = ast.unparse(node.left)
                if any(word in text for word in ("tier", "_memory", "uploader", "_remote")):
                    offenders.append(f"{relative}:{node.lineno} {ast.unparse(node)}")
    assert not offenders, offenders


def test_the_example_tier_of_the_docs_mirrors_keeps_its_newest_and_restores_what_the_directory_lost(
    tmp_path: Path,
) -> None:
    namespace: dict[str, Any] = {}
    exec(compile(docs_example(DOCS / "architecture.md", "A tier of your own"), "architecture.md", "exec"), namespace)
    mirror = tmp_path / "mirror"
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tier = namespace["MirrorTier"](mirror, keep=2)
    with cf.Checkpointer(tmp_path / "run", policy=2, keep=1, tiers=[tier], model=model, optimizer=opt, rng=False) as c:
        for _ in range(6):
            train_step(model, opt)
            c.step()
    mirrored = sorted(p.name for p in mirror.iterdir())  # a checkpoint committed while a copy ran is skipped
    assert mirrored[-1] == "step_000000006" and len(mirrored) <= 2  # but close() mirrors the newest
    assert [p.name for p in (tmp_path / "run").glob("step_*")] == ["step_000000006"]
    trained = {"model": model.state_dict(), "optimizer": opt.state_dict()}

    for lost in (tmp_path / "run").glob("step_*"):  # the checkpoint directory's disk failed
        shutil.rmtree(lost)
    fresh = make_model(seed=1)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    again_tier = namespace["MirrorTier"](mirror)
    with cf.Checkpointer(tmp_path / "run", policy=2, tiers=[again_tier], model=fresh, optimizer=fresh_opt) as again:
        assert again.restore() == 6
    assert_state_equal({"model": fresh.state_dict(), "optimizer": fresh_opt.state_dict()}, trained)
    assert [e["tier"] for e in read_events(tmp_path / "run") if e["event"] == "restore"] == ["mirror"]


def test_a_tier_of_your_own_is_refused_under_several_ranks_and_anything_else_anywhere(tmp_path: Path) -> None:
    with pytest.raises(cf.InvalidArgumentError, match="tiers= takes Tier objects"):
        cf.Checkpointer(tmp_path / "run", tiers=[object()], model=make_model())  # type: ignore[list-item]
    with pytest.raises(cf.InvalidArgumentError, match="tiers= runs in a job of one process; this job has 2 ranks"):
        check_own_tiers([LocalTier(LocalStore(tmp_path / "other"))], world_size=2)
