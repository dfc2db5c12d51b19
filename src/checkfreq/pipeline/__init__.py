"""One checkpoint's path: the snapshot into reused buffers, the background writer, the commit
protocol, retention, the remote tier's upload, the memory tier, and the restore.

Imports: ``ranks``, ``run``, ``policies``, ``storage`` and ``errors``.
"""
