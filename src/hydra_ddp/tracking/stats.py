"""Per-rank training stats between log points, and what happens at each trainer.log_interval:
this rank's row to the Tracker, rank 0's console line and the progress bar. The loss is summed
on the device and read once per interval: one host-device sync per log interval.
"""

from __future__ import annotations

import resource
from typing import Any

import psutil
import torch

from hydra_ddp.distributed import DistEnv
from hydra_ddp.tracking import Tracker, names, peak
from hydra_ddp.tracking.console import Console


class StepStats:
    def __init__(
        self,
        *,
        env: DistEnv,
        tracker: Tracker,
        console: Console,
        log_interval: int,
        total_steps: int,
        start_step: int,
        unit: str,
        items_per_row: int,
    ) -> None:
        self.env, self.tracker, self.console = env, tracker, console
        self.log_interval, self.total_steps = log_interval, total_steps
        self.unit, self.items_per_row = unit, items_per_row
        self.progress = console.progress(total_steps, start_step)
        (self.bar,) = self.progress.task_ids
        self.last_loss = float("nan")  # the mean loss of the newest log interval
        self.total_samples = 0  # items (samples or tokens) trained on by this rank, this run
        self._reset()

    def _reset(self) -> None:
        self.losses: dict[str, torch.Tensor] = {}  # summed over the window's steps
        self.steps = 0
        self.step_time = self.data_wait = 0.0
        self.samples = 0

    def add_step(
        self, losses: dict[str, torch.Tensor], rows: int, seconds: float, data_wait: float
    ) -> None:
        """`losses`: the step's `loss` and the objective's extra terms."""
        # They stay on the device: reading them every step would sync the GPU every step.
        for name, value in losses.items():
            self.losses[name] = value if name not in self.losses else self.losses[name] + value
        self.steps += 1
        self.step_time += seconds
        self.data_wait += data_wait
        self.samples += rows * self.items_per_row
        self.progress.advance(self.bar)

    def due(self, step: int) -> bool:
        return step % self.log_interval == 0 or step == self.total_steps

    def log(self, step: int, grad_norm: torch.Tensor, lrs: dict[str, float], **extra: Any) -> None:
        """`# collective` (the Tracker gathers every rank's stats): this window's per-step
        means and throughput, the learning rates and `extra` (epoch, rows held, ...); starts
        the next window."""
        steps = max(self.steps, 1)
        means = {name: float(total) / steps for name, total in self.losses.items()}
        self.last_loss = means.pop(names.LOSS, float("nan"))
        self.total_samples += self.samples
        stats = {
            names.LOSS: self.last_loss,
            **{f"{names.LOSS_TERM_PREFIX}{name}": value for name, value in means.items()},
            names.STEP_TIME: self.step_time / steps,
            names.DATA_WAIT: self.data_wait / steps,
            names.throughput(self.unit): self.samples / max(self.step_time, 1e-9),
            names.GRAD_NORM: float(grad_norm),
            **lrs,
            **memory_stats(self.env.device),
            **extra,
        }
        self._reset()
        self.tracker.log(step, stats)
        self.progress.update(self.bar, description=f"loss {stats[names.LOSS]:.4f}")
        if self.env.is_main and self.progress.disable:
            self.console.log_step(
                step, self.total_steps, stats, self.tracker.last_aggregate, self.unit
            )

    def close(self) -> None:
        self.progress.stop()


_MB = 1024 * 1024


def memory_stats(device: torch.device) -> dict[str, float]:
    """Current and peak resident memory of this process (and of its GPU, on CUDA, where the
    peak is since the previous call), in MiB."""
    stats = {
        "rss_mb": psutil.Process().memory_info().rss / _MB,
        # ru_maxrss is in KiB on Linux.
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if device.type == "cuda":
        stats["cuda_mem_mb"] = torch.cuda.memory_allocated(device) / _MB
        stats["cuda_peak_mem_mb"] = torch.cuda.max_memory_allocated(device) / _MB
        # The run's peak is kept for summary.json.
        peak.keep_cuda_peak(device)
        torch.cuda.reset_peak_memory_stats(device)
    return stats
