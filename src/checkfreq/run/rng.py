"""The random number generators a training run draws from, as one registrable object."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


class RNGState:
    """Captures and restores Python's, NumPy's, torch's CPU and every CUDA device's generator."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(legacy=False),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(_python_state(state["python"]))
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"].clone())
        if "cuda" in state and torch.cuda.is_available():
            saved = state["cuda"]
            if len(saved) != torch.cuda.device_count():
                raise ValueError(
                    f"checkpoint has RNG states of {len(saved)} CUDA devices, "
                    f"this process sees {torch.cuda.device_count()}"
                )
            torch.cuda.set_rng_state_all([s.clone() for s in saved])


def _python_state(state: Any) -> tuple[Any, ...]:
    version, internal, gauss = state
    return version, tuple(internal), gauss
