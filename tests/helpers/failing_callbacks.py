"""Callbacks that make one rank fail mid-run, each the way a user's job meets it (tests/ on
PYTHONPATH):
`+callbacks.fail._target_=helpers.failing_callbacks.FailOnRank +callbacks.fail.how=...`.

    raise        the callback raises (a bug in the user's code)
    loader       the rank's DataLoader workers are SIGKILLed (the kernel's OOM killer)
    collective   the callback calls an all-reduce on this rank only
    efbig        the rank's file-size limit (ulimit -f) is reached at its next stats write
"""

from __future__ import annotations

import os
import resource
import signal

import psutil
import torch
import torch.distributed as dist


class FailOnRank:
    def __init__(self, how: str, rank: int = 1, at: int = 3) -> None:
        self.how, self.rank, self.at = how, rank, at

    def on_step_end(self, ctx) -> None:
        if ctx.rank != self.rank or ctx.step != self.at:
            return
        if self.how == "raise":
            raise ValueError(f"a bug in the user's callback on rank {ctx.rank}")
        if self.how == "loader":
            for child in psutil.Process().children():  # trainer.num_workers > 0: the loaders
                os.kill(child.pid, signal.SIGKILL)
        elif self.how == "collective":
            dist.all_reduce(torch.zeros(1000))
        elif self.how == "efbig":
            stats = ctx.output_dir / "stats" / f"rank{ctx.rank}.jsonl"
            size = stats.stat().st_size if stats.exists() else 0
            hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
            resource.setrlimit(resource.RLIMIT_FSIZE, (size + 16, hard))
        else:
            raise ValueError(f"how={self.how!r}")
