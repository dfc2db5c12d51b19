"""The gloo process groups checkfreq creates for its own messages, safe across torchrun restarts.

A group's members find each other through the job's key-value store: each rank writes its
address under a key and reads its peers'. ``dist.new_group`` names those keys after a counter
that restarts at the same value in every process, and since torch 2.5 torchrun no longer gives
each restart attempt a store prefix of its own. Wherever the store outlives the workers (the
static launch form always; the c10d form unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), a
restarted rank can therefore read the address its dead predecessor published and fail with
"Gloo connectFullMesh failed ... Connection refused", or wait for a peer that is not listening.

:func:`new_gloo_groups` puts the groups' keys under a token that rank 0 draws for this one call
and hands every rank through the store, in a way no key left by an earlier process can fool:
each rank asks with a fresh random nonce and waits for the answer under a key named after its
nonce; rank 0 answers every nonce it sees until every rank has confirmed under a key named
after the token, in a constant number of store operations per rank (rank 0: per poll). Neither the
restart count (local to each torchrun agent) nor any other value the ranks would have to agree on
beforehand is needed. Where two ranks connect only when they
first exchange a message (:func:`checkfreq.ranks.compat.gloo_group_on_store`), each looks the other's
address up then, under the same keys. See docs/distributed.md.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, cast

import torch.distributed as dist

from checkfreq.errors import CheckfreqError
from checkfreq.ranks.compat import default_store, gloo_group_on_store

_KEYS = "checkfreq/groups"
_POLL_S = 0.005


def new_gloo_groups(
    purposes: Sequence[str], timeout: timedelta, group_timeout: timedelta | None = None
) -> tuple[str, list[dist.ProcessGroup]]:
    """New gloo groups of every rank, one per purpose, whose rendezvous no dead predecessor's keys
    can disturb, and the store prefix that is this call's own (its token's).

    Collective: every rank calls it at the same point with the same ``purposes`` (short names, part
    of the store keys and of each group's description). One token is agreed for the call (once, not once per group);
    each group's keys live under the token and its purpose. ``timeout`` bounds the agreement;
    ``group_timeout`` (``timeout`` if None) is the groups' collective timeout. Raises
    :class:`CheckfreqError` if some rank does not come.
    """
    store = default_store()
    keys = f"{_KEYS}/{'+'.join(purposes)}"
    token = agree_on_token(store, keys, dist.get_rank(), dist.get_world_size(), timeout)
    group_timeout = timeout if group_timeout is None else group_timeout
    return f"{keys}/{token}", [
        gloo_group_on_store(dist.PrefixStore(f"{keys}/{token}/{purpose}", store), group_timeout, f"checkfreq:{purpose}")
        for purpose in purposes
    ]


def agree_on_token(store: dist.Store, keys: str, rank: int, world_size: int, timeout: timedelta) -> str:
    """A token drawn by rank 0 for this call, returned on every rank; keys left in ``store`` under
    ``keys`` by earlier calls or dead processes cannot change it. Collective over ``world_size`` ranks.

    A constant number of store operations per rank: each other rank appends ``<rank>:<nonce>`` to
    one key, waits for the answer under a key named after its nonce, and counts itself in under a
    key named after the token; rank 0 reads the appended asks and the count (a few operations per
    poll), parses only the asks appended since its last poll and answers them at once. Past
    ``timeout``, rank 0 names the ranks it heard no ask from.
    """
    if rank != 0:
        nonce = uuid.uuid4().hex
        answer = f"{keys}/answer/{nonce}"
        cast(Any, store).append(f"{keys}/asks", f"{rank}:{nonce},")  # in torch's Store, not in its stubs
        try:
            store.wait([answer], timeout)
        except RuntimeError as e:  # torch's DistStoreError
            raise CheckfreqError(
                f"rank {rank} got no answer from rank 0 within {timeout.total_seconds():.0f} s while creating "
                f"checkfreq's process group ({keys}): every rank must construct its Checkpointer at the same point"
            ) from e
        token = store.get(answer).decode()
        store.delete_key(answer)
        store.add(f"{keys}/{token}/joined", 1)
        return token
    token = uuid.uuid4().hex
    answered: dict[str, str] = {}  # rank -> the nonce last answered
    read = 0  # bytes of the asks already answered: the asks only grow until every rank has joined
    deadline = time.monotonic() + timeout.total_seconds()
    while store.add(f"{keys}/{token}/joined", 0) < world_size - 1:
        asks = store.get(f"{keys}/asks") if store.check([f"{keys}/asks"]) else b""
        new, read = asks[read:].decode(), len(asks)  # each ask parsed once, not once per poll
        fresh = dict(ask.split(":", 1) for ask in new.split(",") if ask)  # an earlier process's ask comes first
        if fresh:
            answers = [f"{keys}/answer/{nonce}" for nonce in fresh.values()]
            cast(Any, store).multi_set(answers, [token] * len(fresh))  # in torch's Store, not in its stubs
            answered.update(fresh)
        if time.monotonic() > deadline:
            missing = sorted(set(range(1, world_size)) - {int(peer) for peer in answered})
            who = f"ranks {missing}" if missing else "some ranks that asked"
            raise CheckfreqError(
                f"{who} did not join checkfreq's process group ({keys}) within "
                f"{timeout.total_seconds():.0f} s: every rank must construct its Checkpointer at the same point"
            )
        time.sleep(_POLL_S)
    store.delete_key(f"{keys}/asks")  # every rank has its answer: the next call starts from no asks
    return token
