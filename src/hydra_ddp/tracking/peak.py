"""The measured peak memory of one rank's training, which summary.json sets beside the memory
plan (hydra_ddp/memory.py) so that every run checks the plan; how it is measured on CUDA and on
CPU: docs/memory_plan.md, "The plan is checked by every run". None where /proc cannot be read.
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


@contextlib.contextmanager
def saved_bytes(skip: Callable[[torch.UntypedStorage], bool]) -> Iterator[dict[int, int]]:
    """What autograd saves for the backward inside, each storage once unless `skip`s it:
    storage id -> bytes."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if not skip(storage):
            saved[id(storage)] = storage.nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        yield saved


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
    """The peak over a window of `steps` training steps that starts after the first (which
    pages in code and makes the optimizer state): `step()` after each step, `peak()` reads it
    (a window cut short by the run's end too)."""

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

    @contextlib.contextmanager
    def saving(self, model: torch.nn.Module, rows: int, micro_batches: int) -> Iterator[None]:
        """Around the step that opens the window: count what autograd saves for the backward,
        each storage once and not the parameters' (under fsdp2 the ones a unit gathered), per
        micro-batch of `rows` (each micro-batch's backward frees what its forward saved)."""
        if self.steps != 1:
            yield
            return

        def parameter(storage: torch.UntypedStorage) -> bool:
            # The module's parameters as they are now: fsdp2 swaps in the gathered ones.
            return any(id(local(p).untyped_storage()) == id(storage) for p in model.parameters())

        with saved_bytes(skip=parameter) as saved:
            yield
        self.rows = rows
        self.activations = sum(saved.values()) // max(micro_batches, 1)

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
        """The window's peak bytes; None where unmeasurable or no step ran after the first."""
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
    """`on`: glibc maps every block above 128 KiB on its own and trims a heap's free top above
    that (its initial values); off: blocks up to 32 MiB from the heaps and trimming above twice
    that, where glibc's own dynamic threshold ends up (mallopt(3))."""
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
