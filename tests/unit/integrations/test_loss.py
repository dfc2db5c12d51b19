"""LossFeed: each loss reaches the policy once, a CUDA loss only once its copy to the host is done."""

from __future__ import annotations

import math

import pytest
import torch

from checkfreq.integrations.loss import LossFeed


def test_cpu_losses_and_numbers_are_handed_out_once() -> None:
    feed = LossFeed()
    assert feed.take() is None
    feed.push(torch.tensor(2.5))
    assert feed.take() == 2.5 and feed.take() is None
    feed.push(1.25)
    feed.push(None)  # a step without a loss keeps the last one offered
    assert feed.take() == 1.25
    feed.push(torch.tensor(math.nan))
    assert feed.take() is None  # not finite: nothing for a curve fit
    feed.push(torch.ones(3))
    assert feed.take() is None  # not a scalar


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_loss_arrives_after_its_copy_without_a_sync() -> None:
    feed = LossFeed()
    feed.push(torch.tensor(3.0, device="cuda"))
    feed.push(torch.tensor(4.0, device="cuda"))  # the first copy may still be in flight: this one is skipped then
    torch.cuda.synchronize()
    assert feed.take() in (3.0, 4.0)
    assert feed.take() is None
