"""The measured peak memory of one rank's training, which summary.json sets beside the memory
plan (hydra_ddp/memory.py) so that every run checks the plan.

CUDA: torch.cuda.max_memory_allocated, the allocator's own peak of tensor bytes: what the plan
counts. The per-interval stats reset that peak (stats.memory_stats), so they hand it here first.

CPU: there is no allocator peak to read, so the parameters and optimizer state held when the
loop starts, plus how far the process's peak resident memory (Linux's VmHWM, reset at the start
through /proc/self/clear_refs, after malloc_trim hands freed heap memory back) rose above its
resident memory then. That counts what the process touched: the batches and a few MiB of code
and thread stacks the first step pages in; not DDP's buckets, allocated at the wrap, before the
start. glibc's malloc would add its own retention: once a large block is freed it serves blocks
up to that size (up to 32 MiB) from its heaps and keeps what is freed there, 10-40 % above a
training step's tensors (docs/memory_plan.md). So from the first step to the window's end every
block above 128 KiB is mapped and unmapped on its own (mallopt's M_MMAP_THRESHOLD at its
initial value) and the growth is the tensors'; after it, blocks up to 32 MiB come from the heaps
again, where glibc's own adjustment ends up. None where /proc cannot be read or reset.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import sys
from typing import Callable, Iterable, Iterator

import torch
from torch.autograd.graph import saved_tensors_hooks

from hydra_ddp.distributed.fsdp import local

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (glibc's malloc.h)
_cuda_peak: dict[str, int] = {}  # device -> the run's peak before the stats reset it


def keep_cuda_peak(device: torch.device) -> None:
    """Call before resetting CUDA's peak statistics: the run's peak survives the reset."""
    key = str(device)
    _cuda_peak[key] = max(_cuda_peak.get(key, 0), torch.cuda.max_memory_allocated(device))


def held_bytes(model: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """This rank's bytes of parameters, buffers and optimizer state (local shards only)."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [v for o in optimizers for s in o.state.values() for v in s.values()]
    return sum(
        local(t).numel() * local(t).element_size() for t in tensors if torch.is_tensor(t)
    )  # fmt: skip


class PeakMeter:
    """The peak over a window of training steps: `step()` after each step of the loop starts
    it after the first (which pages in code and makes the optimizer state) and ends it
    `steps` steps later (a steady step repeats itself; evaluation and checkpoints come
    later), `peak()` reads it (a window cut short by the run's end too)."""

    STEPS = 4

    def __init__(self, device: torch.device, steps: int = STEPS) -> None:
        self.device = device
        self.window = steps
        self.held = 0
        self.base: int | None = None
        self.steps = 0
        self.frozen: int | None = None
        self.method = "cuda_max_allocated" if device.type == "cuda" else "cpu_rss_growth"
        # What the window's first step saved for the backward, and its micro-batch's rows.
        self.activations: int | None = None
        self.rows = 0
        if device.type != "cuda":  # from the first step on: its heap is the window's too
            _map_large_blocks(True)

    def saving(
        self, model: torch.nn.Module, rows: int, micro_batches: int
    ) -> contextlib.AbstractContextManager:
        """Around the step that opens the window: count what autograd saves for the backward,
        each storage once and not the parameters' (nor views of them; under fsdp2 the
        parameters a unit gathered for its forward), per micro-batch of `rows` (each
        micro-batch's backward frees what its forward saved)."""
        if self.steps != 1:
            return contextlib.nullcontext()
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            # The module's parameters as they are now: fsdp2 swaps in the gathered ones.
            if all(id(local(p).untyped_storage()) != id(storage) for p in model.parameters()):
                saved[id(storage)] = storage.nbytes()
            return t

        @contextlib.contextmanager
        def counting() -> Iterator[None]:
            with saved_tensors_hooks(pack, lambda t: t):
                yield
            self.rows = rows
            self.activations = sum(saved.values()) // max(micro_batches, 1)

        return counting()

    def step(self, held: Callable[[], int]) -> None:
        """After each training step; `held()`: the bytes held at the window's start."""
        self.steps += 1
        if self.steps == 1:
            self.start(held())
        elif self.steps == 1 + self.window:
            self._end()

    def start(self, held: int) -> None:
        if self.device.type == "cuda":
            _cuda_peak.pop(str(self.device), None)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = 0
            return
        self.held = held
        _trim()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
        except OSError:
            return
        self.base = _status("VmRSS")

    def peak(self) -> int | None:
        """The peak bytes of the window; None where they cannot be measured (or no step ran
        after the first)."""
        if self.frozen is None and self.steps > 1:
            self._end()
        return self.frozen

    def _end(self) -> None:
        self.frozen = self._read()
        if self.device.type != "cuda":
            _map_large_blocks(False)

    def _read(self) -> int | None:
        if self.base is None:
            return None
        if self.device.type == "cuda":
            keep_cuda_peak(self.device)
            return _cuda_peak[str(self.device)]
        hwm = _status("VmHWM")
        return None if hwm is None else self.held + hwm - self.base


def _status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            found = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


def _map_large_blocks(on: bool) -> None:
    """glibc: every block above 128 KiB mapped on its own and unmapped when freed, and a heap's
    free top above 128 KiB handed back (`on`: both glibc's initial values), else (after the
    window) blocks up to 32 MiB served from the heaps, where glibc's own dynamic threshold
    stops rising (its maximum on 64-bit, mallopt(3)), and the top trimmed above twice that,
    as glibc then trims."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        threshold = 128 * 2**10 if on else 32 * 2**20
        libc.mallopt(_M_MMAP_THRESHOLD, threshold)
        libc.mallopt(_M_TRIM_THRESHOLD, threshold if on else 2 * threshold)


def _trim() -> None:
    """glibc keeps freed memory for reuse; hand it back, so the growth counts this run only."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).malloc_trim(0)
