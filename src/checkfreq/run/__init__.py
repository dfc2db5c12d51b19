"""The run's own state: registered objects flattened to tensors and JSON, random generators,
the Checkpointer's options, the step order, the session and its timeline, events, signals.

Imports: ``policies``, ``storage``, ``data`` and ``errors`` only.
"""
