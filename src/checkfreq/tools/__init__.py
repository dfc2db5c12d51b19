"""Checkpoints and runs seen from outside a training job: the catalog (list, verify, inspect,
export, diff), the run report, and the failure simulator with each policy's schedule.

Imports: ``pipeline`` and everything below it; never the ``Checkpointer``.
"""
