"""A short training run that checkpoints every step to an S3-protocol server, for kill tests.

Trains ``--steps`` optimizer steps of a 768x768 linear layer with Adam (a ~7 MB data file),
checkpointing after each step and waiting until it is durable (and, with ``--local``, uploaded),
printing ``committed N``. The upload of step ``--slow-step`` trickles in 1 MiB pieces and stalls
once its first part is on the server, so the parent can SIGKILL this process while a multipart
upload is in progress; ``--die-before-manifest
K`` SIGKILLs it right after step K's data file is uploaded and before its manifest is written.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Iterable, Iterator
from pathlib import PurePosixPath

import torch

from checkfreq.checkpointer import Checkpointer
from checkfreq.storage import FsspecStore
from checkfreq.storage.format import MANIFEST_NAME, checkpoint_name

PIECE = 1 << 20
BLOCK = 5 * PIECE  # the multipart part size
STALL_S = 120.0


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(768, 768)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Optimizer step number ``step`` (1-based); its batch depends on the step only."""
    x = torch.randn(8, 768, generator=torch.Generator().manual_seed(step))
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


class KillableStore(FsspecStore):
    """An S3 store whose uploads of one step trickle, or which dies before one step's manifest."""

    def __init__(self, url: str, slow_step: int | None, die_step: int | None, **options: object) -> None:
        super().__init__(url, **options)
        self.slow = checkpoint_name(slow_step) if slow_step else None
        self.die = checkpoint_name(die_step) if die_step else None

    def write_file(self, staging: PurePosixPath, name: str, chunks: Iterable[bytes | memoryview]) -> None:
        if name == MANIFEST_NAME and staging.name == self.die:
            os.kill(os.getpid(), signal.SIGKILL)
        if name != MANIFEST_NAME and staging.name == self.slow:
            chunks = trickle(chunks)
        super().write_file(staging, name, chunks)


def trickle(chunks: Iterable[bytes | memoryview]) -> Iterator[memoryview]:
    """The same bytes in 1 MiB pieces, 0.1 s apart, stalling once a whole part has been written
    (and so uploaded): a slow link that stops, however long the parent takes to see the part."""
    sent = 0
    for chunk in chunks:
        view = memoryview(chunk)
        for start in range(0, len(view), PIECE):
            if sent >= BLOCK:
                time.sleep(STALL_S)
            time.sleep(0.1)
            yield view[start : start + PIECE]
            sent += len(view[start : start + PIECE])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--local", default=None, help="fast local tier; --url becomes the remote tier")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--slow-step", type=int, default=None)
    parser.add_argument("--die-before-manifest", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    remote = KillableStore(
        args.url,
        args.slow_step,
        args.die_before_manifest,
        endpoint_url=args.endpoint,
        key="testing",
        secret="testing",
        default_block_size=BLOCK,
    )
    tiers = {"directory": args.local, "remote": remote, "remote_keep": 10} if args.local else {"directory": remote}
    model, optimizer = build()
    with Checkpointer(**tiers, policy=1, keep=10, model=model, optimizer=optimizer) as ckpt:
        for step in range(1, args.steps + 1):
            train_step(model, optimizer, step)
            ckpt.step()
            ckpt.wait(remote=True)
            print(f"committed {step}", flush=True)


if __name__ == "__main__":
    main()
