"""The state a found checkpoint holds for this rank, ready to load into the registered objects."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from checkfreq.pipeline.restore.protocol import Found
from checkfreq.ranks.cluster import Cluster
from checkfreq.ranks.rebuild import local_view, note_world_size_change
from checkfreq.run.state import unflatten


def restored_state(found: Found, cluster: Cluster, objects: Mapping[str, Any], *, allow_pickle: bool) -> Any:
    """This rank's state in ``found``: a memory snapshot is this rank's own whole state, or its share
    of its machine's put together (:meth:`~checkfreq.pipeline.tiers.roles.StateKeeper.complete`); a checkpoint on
    disk is cut for this rank at any saved world size."""
    if found.held and found.manifest.distributed is None:  # this rank's whole state
        skeleton, tensors = local_view(found.manifest, found.tensors)
    elif found.held:  # a share of its machine's state, DTensors cut to the live ones
        skeleton, tensors = cluster.view(found.manifest, found.tensors, objects)
    else:
        note_world_size_change(found.manifest, cluster.control.rank, cluster.world_size)
        skeleton, tensors = cluster.view(found.manifest, found.tensors, objects)
    return unflatten(skeleton, tensors, allow_pickle=allow_pickle)


def source_of(found: Found, directory: str) -> str:
    """How a message names the checkpoint restored."""
    where = f", read from the {found.tier} tier" if found.elsewhere else ""
    return f"checkpoint {found.name} of {directory}{where}"


__all__ = ["restored_state", "source_of"]
