"""What users would otherwise use: ``torch.save``, ``safetensors`` and DCP, each made durable."""

from __future__ import annotations

import logging
import os
import time
import warnings
from itertools import count
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from benchmarks.methods import Method, Sample, unlink
from benchmarks.states import State

log = logging.getLogger("benchmarks.baselines")


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TorchSave(Method):
    """``torch.save({"model": ..., "optimizer": ...})`` to a file, then ``fsync`` (synchronous)."""

    name = "torch.save+fsync"

    def setup(self, state: State, workdir: Path) -> None:
        self._state, self._path = state, workdir / "torch.pt"

    def run(self) -> Sample:
        start = time.perf_counter()
        with open(self._path, "wb") as f:
            torch.save({"model": self._state.model.state_dict(), "optimizer": self._state.optimizer.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        elapsed = time.perf_counter() - start
        unlink(self._path)
        return Sample(stall=elapsed, durable=elapsed)


class SafetensorsSave(Method):
    """``safetensors.torch.save_file`` of every state tensor, then ``fsync`` (synchronous)."""

    name = "safetensors+fsync"

    def setup(self, state: State, workdir: Path) -> None:
        self._state, self._path = state, workdir / "state.safetensors"

    def run(self) -> Sample:
        start = time.perf_counter()
        save_file(self._state.tensors, self._path)
        fsync_path(self._path)
        elapsed = time.perf_counter() - start
        unlink(self._path)
        return Sample(stall=elapsed, durable=elapsed)


class _Dcp(Method):
    """Shared set-up of the DCP variants: a fresh checkpoint directory per run."""

    def setup(self, state: State, workdir: Path) -> None:
        self._state, self._workdir, self._ids = state, workdir, count()

    def _fresh_dir(self) -> Path:
        path = self._workdir / f"{type(self).__name__}-{next(self._ids)}"
        path.mkdir()
        return path


class DcpSave(_Dcp):
    """``dcp.save`` with two writer threads (its fastest setting here), synchronous."""

    name = "DCP save (2 threads)"

    def run(self) -> Sample:
        path = self._fresh_dir()
        start = time.perf_counter()
        dcp.save(self._state.tensors, storage_writer=dcp.FileSystemWriter(path, thread_count=2), no_dist=True)
        elapsed = time.perf_counter() - start
        unlink(path)
        return Sample(stall=elapsed, durable=elapsed)


class DcpAsyncThread(_Dcp):
    """``dcp.async_save`` on the thread executor with one persistent ``DefaultStager``.

    ``async_staging=False``: the stager copies into its cached buffers before returning.
    ``async_staging=True``: it returns at once and copies on a thread; the state must not change
    until ``staging_completion`` resolves, so that wait is part of the stall.
    ``fresh_stager=True``: a new stager for every save (torch 2.11's ``DefaultStager`` raises
    ``KeyError: <class 'type'>`` when reused on CUDA state), closed once the save is durable.
    """

    def __init__(self, async_staging: bool, fresh_stager: bool = False) -> None:
        self.async_staging = async_staging
        self.fresh_stager = fresh_stager
        self.name = f"DCP async_save thread, {'async' if async_staging else 'cached'} staging"
        if fresh_stager:
            self.name += ", a stager per save"

    def setup(self, state: State, workdir: Path) -> None:
        super().setup(state, workdir)
        self._cuda = torch.cuda.is_available() and any(t.is_cuda for t in state.tensors.values())
        self._stager = None if self.fresh_stager else self._new_stager()

    def _new_stager(self) -> DefaultStager:
        return dcp_stager(self._cuda, self.async_staging)

    def run(self) -> Sample:
        path = self._fresh_dir()
        start = time.perf_counter()
        stager = self._new_stager() if self._stager is None else self._stager
        result = dcp.async_save(
            self._state.tensors, storage_writer=dcp.FileSystemWriter(path), async_stager=stager, no_dist=True
        )
        if isinstance(result, AsyncSaveResponse):
            result.staging_completion.result()
            upload = result.upload_completion
        else:
            upload = result
        stall = time.perf_counter() - start
        upload.result()
        durable = time.perf_counter() - start
        if stager is not self._stager:
            stager.close()
        unlink(path)
        return Sample(stall=stall, durable=durable, write=durable - stall)

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()


def dcp_stager(cuda: bool, async_staging: bool) -> DefaultStager:
    """A ``DefaultStager`` as DCP's docs set it up for ``async_save``: pinned, non-blocking copies on CUDA."""
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=async_staging, use_non_blocking_copy=cuda
        )
    )


class DcpAsyncProcess(_Dcp):
    """``dcp.async_save`` on the process executor (needs a process group: one-rank gloo)."""

    name = "DCP async_save process"

    def setup(self, state: State, workdir: Path) -> None:
        super().setup(state, workdir)
        if not dist.is_initialized():
            store = dist.FileStore(str(workdir / "pg-store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)

    def run(self) -> Sample:
        path = self._fresh_dir()
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            future = dcp.async_save(
                self._state.tensors,
                storage_writer=dcp.FileSystemWriter(path),
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            )
        stall = time.perf_counter() - start
        future.result()
        durable = time.perf_counter() - start
        unlink(path)
        return Sample(stall=stall, durable=durable, write=durable - stall)
