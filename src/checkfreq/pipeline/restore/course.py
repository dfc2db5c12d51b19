"""The course of a run: which states its memory snapshots belong to.

A step number alone does not name a state. A run that goes back to an older step (a restore of an
older checkpoint, a restore from disk while a node's memory held newer snapshots) takes the numbers
of the steps after it again, for other states; a node absent from that restore keeps the snapshots
of the course the run left, under the same numbers. So every memory snapshot, and every copy of one
kept on another machine, carries its course, and the restore takes a snapshot only where every rank
holds it, or a copy of it, at one step *and* one course.

Rank 0 draws a session's first course at start-up (:func:`draw_course`) and sends it with the newest
step; each restore of the session then moves every rank to the next course (:func:`next_course`), the
same on every rank without a message: the restores of a session are collective, so every rank
counts the same number.
"""

from __future__ import annotations

import secrets

import xxhash

COURSE_BITS = 62
"""Courses are positive and fit a signed 64-bit integer (a copy's header carries one as an int64)."""


def draw_course() -> int:
    """A new session's course, drawn by rank 0: never 0 (a slot of no known course)."""
    return secrets.randbits(COURSE_BITS) + 1


def next_course(first: int, restores: int) -> int:
    """The course of a session that began with ``first`` after its ``restores``-th restore."""
    return (xxhash.xxh3_64_intdigest(f"{first}:{restores}".encode()) >> (64 - COURSE_BITS)) + 1
