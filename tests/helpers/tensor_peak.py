"""A user's callback that measures the peak of tensor memory over a window of training steps
on the CPU, where no allocator keeps a peak (the CUDA allocator's is max_memory_allocated):
torch's profiler records every allocation and free; their running sum, in time order, peaks at
the step's peak. What test_memory_plan.py holds the memory plan against."""

from __future__ import annotations

import json

from torch.profiler import ProfilerActivity, profile


class TensorPeak:
    """From the optimizer step of step `start` (the optimizer state exists from then on) to
    that of step `start + steps`: the bytes allocated above the window's start, at their peak,
    written with the bytes of the model's buffers and gradients to <output dir>/
    tensor_peak_rank<r>.json. The parameters, gradients and optimizer state alive at the start
    are summary.json's state_bytes_per_rank. The profiler does not see a tensor made before
    it started being freed: the gradients alive at the start are freed after that optimizer
    step unseen, so from then on the running sum is above the truth by their bytes."""

    def __init__(self, start: int = 2, steps: int = 4) -> None:
        self.start, self.steps = start, steps
        self.prof: profile | None = None

    def on_before_optimizer_step(self, ctx) -> None:
        step = ctx.step  # the step being taken
        if step == self.start:
            self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.prof.__enter__()
        elif step == self.start + self.steps and self.prof is not None:
            self.prof.__exit__(None, None, None)
            now = peak = 0
            for e in sorted(self.prof.events(), key=lambda e: e.time_range.start):
                now += e.self_cpu_memory_usage
                peak = max(peak, now)
            sizes = {
                "above_start": peak,
                "buffers": sum(b.numel() * b.element_size() for b in ctx.model.buffers()),
                "grads": sum(
                    p.numel() * p.element_size() for p in ctx.model.parameters() if p.requires_grad
                ),
            }
            out = ctx.output_dir / f"tensor_peak_rank{ctx.rank}.json"
            out.write_text(json.dumps(sizes))
            self.prof = None
