"""The tiers: where a checkpoint lives. The roles a tier plays (:mod:`~.roles`), the local directory
(:mod:`~.local`), the remote tier (:mod:`~.remote`), the memory tier and its copies on other
machines (:mod:`~.memory`), and the one place a Checkpointer's tiers are chosen (:mod:`~.chosen`)."""
