"""One session of the overhead loop under the default policy, SIGKILLed after step ``--kill-at``.

``python killed_session.py DIR --kill-at K``: warms up, restores from DIR if it holds a checkpoint, trains
with ``Checkpointer(DIR, model=..., optimizer=...)`` (``policy="auto"``), and kills itself with
SIGKILL right after optimizer step K, whatever is in flight. Prints one JSON line per checkpoint
the policy started: ``{"checkpoint": step}``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
from overhead_loop import setup, train  # beside this script

from checkfreq import Checkpointer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("--kill-at", type=int, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, opt, x, y = setup()
    train(30, None, model, opt, x, y)  # warm up, as resumed_sessions does before what it compares with
    ckpt = Checkpointer(args.directory, keep=2, model=model, optimizer=opt)
    ckpt.restore()
    while True:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if ckpt.step():
            print(json.dumps({"checkpoint": ckpt.global_step}), flush=True)
        if ckpt.global_step >= args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
