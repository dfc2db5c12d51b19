"""Training states of a chosen size: transformer-shaped layers plus Adam's moments.

A state of ``S`` bytes holds about ``S / 12`` float32 parameters (parameter, ``exp_avg``,
``exp_avg_sq``). Layers have the shapes of a GPT-style block (QKV, attention output, 4×
MLP, layer norms) and an embedding, so tensor sizes and counts look like a real model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

VOCAB = 8192


class Block(nn.Module):
    """The parameter shapes of one transformer block (the forward pass is not needed here)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)


@dataclass
class State:
    """A model, its Adam optimizer (moments initialised) and every state tensor by name."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def width_for(megabytes: float) -> int:
    """Model width for a target state size: small states get narrow layers, as small models do."""
    if megabytes < 20:
        return 128
    if megabytes < 300:
        return 512
    return 1024


def build_state(megabytes: float, seed: int = 0, device: str = "cpu") -> State:
    """A model + Adam state of about ``megabytes`` MB (1 MB = 1e6 bytes) on ``device``."""
    torch.manual_seed(seed)
    d = width_for(megabytes)
    params_wanted = megabytes * 1e6 / 12
    per_block = 12 * d * d + 13 * d
    blocks = max(1, round((params_wanted - VOCAB * d) / per_block))
    model = nn.Sequential(nn.Embedding(VOCAB, d), *[Block(d) for _ in range(blocks)], nn.LayerNorm(d)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return State(model, optimizer, state_tensors(model, optimizer))


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the model and optimizer state, flat, by a unique name."""
    tensors = {f"model/{k}": v.detach() for k, v in model.state_dict().items()}
    for index, slots in optimizer.state_dict()["state"].items():
        for key, value in slots.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer/{index}/{key}"] = value
    return tensors
