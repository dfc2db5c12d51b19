"""Whether a process of this machine has ended, from the identity it published."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace

import pytest

from checkfreq.ranks.processes import ProcessIdentity, has_ended, this_process


@pytest.fixture
def me() -> ProcessIdentity:
    identity = this_process()
    if identity is None:
        pytest.skip("/proc cannot tell this platform's processes")
    return identity


def _identity_of(pid: int, me: ProcessIdentity) -> ProcessIdentity:
    """A child's identity as it would publish it (read from /proc the way this_process reads its own)."""
    text = open(f"/proc/{pid}/stat").read()
    return ProcessIdentity(me.kernel, pid, int(text[text.rfind(")") + 2 :].split()[19]))


def test_a_running_process_has_not_ended_and_a_dead_one_has_whether_reaped_or_not(me: ProcessIdentity) -> None:
    assert has_ended(me) is False
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        identity = _identity_of(child.pid, me)
        assert has_ended(identity) is False
        child.kill()
        deadline = time.monotonic() + 30
        while not has_ended(identity) and time.monotonic() < deadline:  # a zombie until reaped: ended
            time.sleep(0.01)
        assert has_ended(identity) is True
    finally:
        child.wait()
    assert has_ended(identity) is True  # reaped: no such process


def test_another_process_under_the_same_pid_or_another_kernel(me: ProcessIdentity) -> None:
    assert has_ended(replace(me, started=me.started + 1)) is True  # the pid given to a later process
    assert has_ended(replace(me, kernel="another-boot/pid:[1]")) is None  # another machine or container
    assert ProcessIdentity.from_wire(me.to_wire()) == me
