"""The memory tier: snapshots in shared-memory slots that outlive the process (:mod:`~.tier`), opened
in a job (:mod:`~.opening`), pinned for the GPU (:mod:`~.slot_pinning`), and copied to other machines
(:mod:`~.replicas` moves the bytes, :mod:`~.replica_parts` decides which bytes a copy carries)."""
