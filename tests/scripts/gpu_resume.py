"""Kill and resume a small GPT on the GPU (or the CPU): the resumed run must end bit-identical.

A 2-layer GPT with dropout (the CUDA generator's state matters), deterministic algorithms, AdamW
and batches drawn from a generator seeded by the step (the data does not depend on the RNG
state). Restores from ``--dir`` if it holds a checkpoint or a memory snapshot, trains to
``--steps`` and writes the final model and optimizer state to ``--out``. With ``--die-at K`` it
waits until the state of step ``K`` is committed (on disk, or in the memory tier) and SIGKILLs
itself. Prints ``ready <restored step>`` and ``done``.

    python tests/scripts/gpu_resume.py --dir run --out final.safetensors --memory 1 --die-at 13
"""

from __future__ import annotations

import argparse
import os
import signal

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA starts

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch import nn  # noqa: E402

import checkfreq as cf  # noqa: E402

VOCAB, D, LAYERS, HEADS, SEQ, BATCH = 64, 64, 2, 2, 32, 4


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        layer = nn.TransformerEncoderLayer(D, HEADS, 4 * D, dropout=0.1, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(D, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens), mask=self.mask, is_causal=True))


def batch(step: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator).to(device)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--policy", type=int, default=5)
    p.add_argument("--memory", type=int, default=0)
    p.add_argument("--die-at", type=int)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    torch.use_deterministic_algorithms(True)
    if device.type == "cuda":  # the math attention kernels: the fused ones' backward may be nondeterministic
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.manual_seed(0)
    model = GPT().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with cf.Checkpointer(args.dir, policy=args.policy, memory=args.memory or False, model=model, optimizer=opt) as ckpt:
        start = ckpt.restore()
        print("ready", start, flush=True)
        for step in range(start + 1, args.steps + 1):
            tokens = batch(step, device)
            loss = F.cross_entropy(model(tokens[:, :-1]).view(-1, VOCAB), tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            ckpt.step(loss.item())
            if step == args.die_at:
                ckpt.wait()  # the checkpoint (or memory snapshot) of this step is committed
                os.kill(os.getpid(), signal.SIGKILL)
    state = {f"model/{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        state.update({f"opt/{i}/{k}": torch.as_tensor(v).cpu().contiguous() for k, v in s.items()})
    save_file(state, args.out)
    print("done", flush=True)


if __name__ == "__main__":
    main()
