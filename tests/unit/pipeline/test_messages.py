"""Every message the ranks exchange is a typed value that survives the wire: for arbitrary valid values,
``from_wire(json.loads(json.dumps(m.to_wire()))) == m``, and, for the few sent as a tensor of int64s,
``from_tensor(m.to_tensor()) == m`` through the tensor's bytes. The lists of message classes are found
in the sources (every class with a ``to_wire`` and a ``from_wire``, or a ``to_tensor`` and a
``from_tensor``), so a new message without a strategy here fails
:func:`test_every_message_class_has_a_strategy` or :func:`test_every_tensor_message_class_has_a_strategy`."""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import checkfreq
from checkfreq.pipeline.restore.messages import (
    ALL_FILES,
    ORDERS,
    Agenda,
    CheckpointView,
    CopyTransfer,
    CopyUnreadable,
    DamageReport,
    ExchangeOrder,
    ExchangeOutcome,
    ExchangeVerdict,
    FetchPlan,
    FileTransfer,
    Holdings,
    ListedSteps,
    MemoryChoice,
    MemoryReport,
    NewestStep,
    ReadFrom,
    ReadOrder,
    Refusal,
    decode_copy_transfer,
    decode_order,
)
from checkfreq.pipeline.retention.best import BestChoice
from checkfreq.pipeline.save.commit import Claims, CommitReport, CommitReports, DamagedSteps, Verdict
from checkfreq.pipeline.tiers.memory.replicas import SNAPSHOT, STOP, CopyAnswer, CopyHeader
from checkfreq.pipeline.tiers.remote import UploadOutcome
from checkfreq.ranks.agreement import Vote
from checkfreq.ranks.collectives import (
    RankError,
    RankErrors,
    Solo,
    all_gather_messages,
    broadcast_message,
    collect_errors,
    gather_messages,
    scatter_messages,
)
from checkfreq.ranks.liveness import Whoami
from checkfreq.ranks.messages import DirectoryKey, DirectoryLeader, GroupMembers, Token
from checkfreq.ranks.processes import ProcessIdentity

# ---------------------------------------------------------------------------------- values

texts = st.text(max_size=20)
ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)
counts = st.integers(min_value=0, max_value=2**40)
snapshot_keys = st.tuples(counts, counts)
"""A memory snapshot as the restore names it: its step and its course."""
checksums = st.integers(min_value=0, max_value=2**64 - 1)
signatures = st.binary(min_size=16, max_size=16)
optional_texts = st.none() | texts
json_values = st.recursive(
    st.none() | st.booleans() | ints | st.floats(allow_nan=False, allow_infinity=False) | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
json_objects = st.dictionaries(texts, json_values, max_size=4)
file_pairs = st.tuples(texts, counts)


@st.composite
def tensor_records(draw: st.DrawFn) -> dict[str, Any]:
    record: dict[str, Any] = {
        "dtype": draw(st.sampled_from(["F32", "BF16", "I64"])),
        "shape": draw(st.lists(counts, max_size=3)),
        "kind": draw(st.sampled_from(["replicated", "private", "sharded"])),
        "parts": draw(st.lists(st.lists(texts | counts, max_size=3), max_size=3)),
    }
    if draw(st.booleans()):
        record["chunked"] = draw(counts)
    return record


replica_claims = st.fixed_dictionaries(
    {
        "layout": st.lists(st.tuples(texts, texts, st.lists(counts, max_size=3)).map(list), max_size=4),
        "fingerprints": st.dictionaries(texts, texts, max_size=4),
    }
)


@st.composite
def commit_reports(draw: st.DrawFn) -> CommitReport:
    """One of the three kinds of report: a failure, one process's, or one rank's of several."""
    report = CommitReport(draw(counts), draw(st.floats(allow_nan=False, allow_infinity=False)))
    kind = draw(st.sampled_from(["failed", "one process", "ranks"]))
    if kind == "failed":
        report.error = draw(optional_texts)
    else:
        report.ok, report.file, report.size, report.xxh3_64 = True, draw(texts), draw(counts), draw(texts)
        report.upload_idle = draw(st.booleans())
        if kind == "one process":
            report.index, report.state = draw(json_objects), draw(json_values)
        else:
            report.agree, report.directory_leader = draw(texts), draw(counts)
    if kind != "one process":
        report.leader = draw(st.none() | st.booleans())
    report.score = draw(st.none() | json_objects)
    return report


verdicts = (
    st.lists(texts, min_size=1, max_size=4).map(lambda errors: Verdict(errors=errors))
    | st.just(Verdict(mismatch=True))
    | st.builds(Verdict, upload=st.booleans(), several=st.booleans())
)
holdings = st.builds(
    Holdings,
    held=st.none() | st.just(ALL_FILES) | st.lists(texts, max_size=4),
    remote=st.booleans(),
    cache=st.none() | counts,
    directory_leader=counts,
    files=texts,
    needs=st.none() | st.lists(counts, max_size=4),
)

STRATEGIES: dict[type, st.SearchStrategy[Any]] = {
    # ranks: start-up and errors
    RankError: st.builds(RankError, optional_texts),
    RankErrors: st.builds(RankErrors, st.lists(texts, max_size=4)),
    Token: st.builds(Token, texts),
    DirectoryKey: st.builds(DirectoryKey, texts),
    DirectoryLeader: st.builds(DirectoryLeader, counts),
    GroupMembers: st.builds(
        GroupMembers, st.lists(counts, max_size=8), st.lists(counts, max_size=3), st.lists(counts, max_size=3)
    ),
    Whoami: st.builds(Whoami, texts, counts, st.none() | st.builds(ProcessIdentity, texts, counts, counts)),
    ProcessIdentity: st.builds(ProcessIdentity, texts, counts, counts),
    # commit and upload
    CommitReport: commit_reports(),
    Verdict: verdicts,
    CommitReports: st.builds(CommitReports, st.lists(commit_reports(), max_size=3)),
    Claims: st.builds(Claims, replica_claims, st.dictionaries(texts, tensor_records(), max_size=3)),
    DamagedSteps: st.builds(DamagedSteps, st.lists(st.integers(0, 10**12), max_size=4)),
    UploadOutcome: st.just(UploadOutcome()) | st.builds(UploadOutcome, st.just(False), optional_texts),
    # restore
    MemoryReport: st.builds(
        MemoryReport,
        st.lists(snapshot_keys, max_size=4),
        st.none() | counts,
        st.dictionaries(counts, st.lists(snapshot_keys, max_size=2), max_size=2),
    ),
    FetchPlan: st.builds(FetchPlan, st.none() | counts, st.lists(st.tuples(counts, counts), max_size=3), texts, counts),
    MemoryChoice: st.builds(MemoryChoice, st.none() | snapshot_keys, st.booleans()),
    NewestStep: st.builds(NewestStep, st.none() | counts, counts),
    ListedSteps: st.builds(ListedSteps, st.lists(counts, max_size=4)),
    Agenda: st.builds(Agenda, st.lists(counts, max_size=4), st.dictionaries(counts, texts, max_size=4), st.booleans()),
    Holdings: holdings,
    CheckpointView: st.builds(CheckpointView, holdings | texts),
    ReadOrder: st.builds(
        ReadOrder, st.lists(st.tuples(texts, st.sampled_from(list(ReadFrom))), max_size=4), st.booleans()
    ),
    ExchangeOrder: st.builds(
        ExchangeOrder,
        st.lists(texts, max_size=3),
        st.lists(file_pairs, max_size=3),
        st.lists(file_pairs, max_size=3),
        counts,
        st.booleans(),
    ),
    Refusal: st.builds(Refusal, texts),
    DamageReport: st.builds(DamageReport, st.dictionaries(texts, texts, max_size=4)),
    FileTransfer: st.builds(FileTransfer, json_objects, counts),
    ExchangeOutcome: st.builds(ExchangeOutcome, optional_texts, optional_texts),
    ExchangeVerdict: st.builds(ExchangeVerdict, st.lists(texts, max_size=4), st.none() | st.tuples(counts, texts)),
    CopyTransfer: st.builds(CopyTransfer, counts, counts, checksums, signatures, texts),
    CopyUnreadable: st.builds(CopyUnreadable, texts, texts),
    BestChoice: st.builds(BestChoice, st.none() | counts, st.booleans()),
}

TENSOR_STRATEGIES: dict[type, st.SearchStrategy[Any]] = {
    Vote: st.builds(Vote, st.booleans(), st.integers(min_value=0, max_value=2**62)),
    CopyHeader: st.builds(
        CopyHeader, st.sampled_from([SNAPSHOT, STOP]) | ints, ints, counts, counts, checksums, signatures
    ),
    CopyAnswer: st.builds(CopyAnswer, st.none() | counts),
}
"""The messages sent as a tensor of int64s (``to_tensor``, and the class's ``from_tensor``)."""


def message_classes(encode: str = "to_wire", decode: str = "from_wire") -> set[type]:
    """Every class in checkfreq's sources with both an ``encode`` and a ``decode`` method (but a protocol)."""
    root = Path(checkfreq.__file__).parent
    found = set()
    for path in sorted(root.rglob("*.py")):
        if f"def {encode}" not in path.read_text():
            continue
        name = ".".join(("checkfreq", *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if getattr(cls, "_is_protocol", False):  # the Message protocol itself
                continue
            if cls.__module__ == name and callable(getattr(cls, encode, None)) and callable(getattr(cls, decode, None)):
                found.add(cls)
    return found


def test_every_message_class_has_a_strategy() -> None:
    found = message_classes()
    assert len(found) >= len(STRATEGIES) > 20
    missing = sorted(c.__qualname__ for c in found - set(STRATEGIES))
    assert not missing, f"message classes with no strategy in {__name__}.STRATEGIES: {missing}"
    assert set(STRATEGIES) <= found, sorted(c.__qualname__ for c in set(STRATEGIES) - found)


@pytest.mark.parametrize("cls", sorted(STRATEGIES, key=lambda c: c.__qualname__), ids=lambda c: c.__qualname__)
def test_every_message_survives_the_wire(cls: type) -> None:
    @settings(max_examples=60, deadline=None)
    @given(STRATEGIES[cls])
    def round_trip(message: Any) -> None:
        assert type(message) is cls
        wire = json.loads(json.dumps(message.to_wire()))
        assert cls.from_wire(wire) == message
        assert json.dumps(cls.from_wire(wire).to_wire()) == json.dumps(message.to_wire())

    round_trip()


@settings(max_examples=60, deadline=None)
@given(st.one_of(*(STRATEGIES[kind] for kind in ORDERS)))
def test_an_order_decodes_to_its_own_kind_by_its_tag(order: ReadOrder | ExchangeOrder | Refusal) -> None:
    assert decode_order(json.loads(json.dumps(order.to_wire()))) == order


def test_the_orders_tags_tell_them_apart() -> None:
    tags = [kind.TAG for kind in ORDERS]
    assert len(set(tags)) == len(tags)
    examples = [
        ReadOrder([("rank00000.safetensors", ReadFrom.DIRECTORY)], True),
        ExchangeOrder([], [], [], 0, False),
        Refusal("no manifest"),
    ]
    assert [type(e) for e in examples] == list(ORDERS)
    for example in examples:  # a kind's wire form holds its own tag and no other kind's
        assert {k for k in example.to_wire() if k in tags} == {example.TAG}
    for wire in ({}, {"read": [], "pack": False, "problem": "x"}, [], "read"):
        with pytest.raises(ValueError, match="not an order"):
            decode_order(wire)


@settings(max_examples=60, deadline=None)
@given(st.one_of(STRATEGIES[CopyTransfer], STRATEGIES[CopyUnreadable]))
def test_a_copy_transfer_decodes_to_its_own_kind(header: CopyTransfer | CopyUnreadable) -> None:
    assert decode_copy_transfer(json.loads(json.dumps(header.to_wire()))) == header


def test_every_tensor_message_class_has_a_strategy() -> None:
    found = message_classes("to_tensor", "from_tensor")
    missing = sorted(c.__qualname__ for c in found - set(TENSOR_STRATEGIES))
    assert not missing, f"tensor message classes with no strategy in {__name__}.TENSOR_STRATEGIES: {missing}"
    assert set(TENSOR_STRATEGIES) <= found, sorted(c.__qualname__ for c in set(TENSOR_STRATEGIES) - found)


@pytest.mark.parametrize("cls", sorted(TENSOR_STRATEGIES, key=lambda c: c.__qualname__), ids=lambda c: c.__qualname__)
def test_every_tensor_message_survives_the_wire(cls: type) -> None:
    """Encoded, sent as the tensor's bytes (what gloo moves), received into an int64 tensor, decoded."""

    @settings(max_examples=60, deadline=None)
    @given(TENSOR_STRATEGIES[cls])
    def round_trip(message: Any) -> None:
        assert type(message) is cls
        tensor = message.to_tensor()
        assert tensor.dtype == torch.int64 and tensor.dim() == 1
        assert tensor.numel() == getattr(cls, "WIDTH", tensor.numel())
        received = torch.frombuffer(bytearray(tensor.numpy().tobytes()), dtype=torch.int64)
        assert cls.from_tensor(received) == message
        assert torch.equal(cls.from_tensor(received).to_tensor(), tensor)

    round_trip()


def test_the_replica_headers_carry_the_same_int64s_as_before() -> None:
    """A copy's header: kind, step, data and manifest bytes, the checksum as signed, the signature as
    two, a 0; the end of the copies all zeros; the keeper's answer the step kept or -1."""
    header = CopyHeader(SNAPSHOT, 7, 100, 20, 2**64 - 1, bytes(range(16)))
    low, high = int.from_bytes(bytes(range(8)), "little"), int.from_bytes(bytes(range(8, 16)), "little")
    assert header.to_tensor().tolist() == [1, 7, 100, 20, -1, low, high, 0]
    assert CopyHeader.stop().to_tensor().tolist() == [0] * CopyHeader.WIDTH
    assert CopyAnswer(7).to_tensor().tolist() == [7] and CopyAnswer(None).to_tensor().tolist() == [-1]
    info = header.info
    assert CopyHeader.announcing(info) == header and (info.step, info.checksum, info.signature) == (
        7,
        2**64 - 1,
        bytes(range(16)),
    )


def test_a_vote_result_is_the_elementwise_maximum() -> None:
    """What tree_max computes of the ranks' votes: some rank wanted a checkpoint, the fewest steps proposed."""
    votes = [Vote(False, 40), Vote(True, 7), Vote(False, 12)]
    result = Vote.from_tensor(torch.stack([v.to_tensor() for v in votes]).max(dim=0).values)
    assert result == Vote(True, 7)


def test_the_wire_carries_the_same_json_as_before() -> None:
    """The typed messages encode as the raw values did: no byte more on the wire."""
    assert RankError(None).to_wire() is None and RankErrors(["a"]).to_wire() == ["a"]
    assert Token("0123456789ab").to_wire() == "0123456789ab" and DirectoryLeader(3).to_wire() == 3
    assert Whoami("node", 12).to_wire() == {"host": "node", "pid": 12}
    assert UploadOutcome().to_wire() == {"ok": True} and UploadOutcome(False, "e").to_wire() == {
        "ok": False,
        "error": "e",
    }
    assert MemoryChoice((5, 9), True).to_wire() == [[5, 9], True] and ListedSteps([3, 1]).to_wire() == [3, 1]
    assert ExchangeOutcome("p", None).to_wire() == ["p", None]
    assert ExchangeVerdict(["e"], (2, "w")).to_wire() == [["e"], [2, "w"]]
    assert FileTransfer({"a": 1}, 4).to_wire() == {"header": {"a": 1}, "size": 4}
    assert DamageReport({"f": "why"}).to_wire() == {"f": "why"}
    assert CheckpointView("no manifest").to_wire() == "no manifest"
    assert CopyUnreadable("damaged", "node").to_wire() == {"error": "damaged", "host": "node"}
    assert CopyTransfer(3, 4, 5, b"\x01\x02", "node").to_wire() == {
        "meta": 3,
        "data": 4,
        "checksum": 5,
        "signature": "0102",
        "host": "node",
    }
    assert Claims({"layout": [], "fingerprints": {}}, {}).to_wire() == {
        "replicas": {"layout": [], "fingerprints": {}},
        "sharded": {},
    }


def test_the_typed_helpers_in_a_world_of_one() -> None:
    solo = Solo()
    assert gather_messages(solo, Token("t"), Token.from_wire) == [Token("t")]
    assert broadcast_message(solo, MemoryChoice(None, False), MemoryChoice.from_wire) == MemoryChoice(None, False)
    assert all_gather_messages(solo, DirectoryKey("k"), DirectoryKey.from_wire) == [DirectoryKey("k")]
    assert scatter_messages(solo, [Refusal("no")], decode_order) == Refusal("no")
    assert collect_errors(solo, None) == [] and collect_errors(solo, "rank 0: broke") == ["rank 0: broke"]
