"""The ranks a Checkpointer works with: the ``Cluster`` interface (a ``GroupCluster`` under
torch.distributed, a ``SoloCluster`` alone), checkfreq's own gloo groups and messages, which rank
writes which bytes, shared directories, the policy vote, and proof that replicas agree.

Imports: ``run``, ``policies``, ``storage`` and ``errors``; never the training process group after
start-up, never ``pipeline``.
"""
