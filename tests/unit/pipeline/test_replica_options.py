"""``replicas=`` and ``replica_stride=``: what a Checkpointer accepts, and the clear error otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkfreq import Checkpointer, InvalidArgumentError


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"replicas": -1}, r"replicas must be an int >= 0 \(copies on other machines\), got -1"),
        ({"replicas": True}, r"replicas must be an int >= 0 \(copies on other machines\), got True"),
        (
            {"replicas": 2, "replica_stride": 0},
            r"replica_stride must be an int >= 1 \(machine i copies to machine "
            r"i \+ replica_stride, then i \+ 2 \* replica_stride, ...\), got 0",
        ),
        (
            {"replicas": 2, "memory": False},
            r"replicas= copies memory snapshots to another machine: it needs memory= too",
        ),
    ],
)
def test_bad_replica_options_are_refused_by_name(tmp_path: Path, shm_dir: Path, options: dict, message: str) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(InvalidArgumentError, match=message):
        Checkpointer(tmp_path, **{"memory": 1, **options}, model=model)


def test_copies_asked_of_a_job_of_one_process_are_none_with_a_warning(
    tmp_path: Path, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = Checkpointer(tmp_path, memory=1, replicas=3, replica_stride=2, model=torch.nn.Linear(2, 2))
    ckpt.step()
    ckpt.close()
    assert "replicas=3 in a job of one process: no other machine to copy to" in caplog.text
