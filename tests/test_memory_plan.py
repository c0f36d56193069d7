"""The memory plan (hydra_ddp/memory.py, `python -m hydra_ddp.plan`) against what training
measures: the CPU tensor peak of real steps (`RecordedPeak` below: torch's profiler over steps
2-5), within 25 %, for the digits MLP and the example GPT at two widths, on one rank and under
ddp and fsdp2 on two gloo ranks; the same plan in summary.json beside the run's own measured
peak."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import FAST
from helpers.inproc import train_here, train_ranks, typed
from torch.profiler import ProfilerActivity, profile

from hydra_ddp import memory
from hydra_ddp import memory as rules
from hydra_ddp.components import build
from hydra_ddp.config import Wrapper
from hydra_ddp.distributed.fsdp import local
from hydra_ddp.plan import parse_bytes


class RecordedPeak:
    """A user's callback: the peak of tensor memory over a window of training steps on the
    CPU, where no allocator keeps one. From the optimizer step of step `start` (the optimizer
    state exists from then on) to that of step `start + steps`, the profiler's allocation
    records (each allocation and each free, by address, in time order) summed: their peak is
    the bytes allocated above the window's start, written with this rank's bytes of buffers
    and gradients to <output dir>/tensor_peak_rank<r>.json. The parameters, gradients and
    optimizer state alive at the start are summary.json's state_bytes_per_rank; the free of a
    tensor made before the window is not recorded (the gradients alive at the start, freed by
    the next zero_grad), so from then on the sum is above the truth by their bytes.

    Paired by address, not summed per operator as an earlier measure did
    (`prof.events()`'s self_cpu_memory_usage): the profiler records only the threads it
    profiles, and gloo frees some of fsdp2's buffers on its own threads (its reduce-scatter
    clones the input); an allocation at an address still held ends the tensor that held it.
    The per-operator sums climbed ~3.3 MB a step for the GPT of width 128 under fsdp2 (a
    measured 22-24 MB against 14-15 MB by address) and by the whole model a step for the
    digits MLP."""

    def __init__(self, start: int = 2, steps: int = 4) -> None:
        self.start, self.steps = start, steps
        self.prof: profile | None = None

    def on_before_optimizer_step(self, ctx) -> None:
        if ctx.step == self.start:
            self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.prof.__enter__()
        elif ctx.step == self.start + self.steps and self.prof is not None:
            self.prof.__exit__(None, None, None)
            nodes = list(self.prof.profiler.kineto_results.experimental_event_tree())
            records = []
            while nodes:
                node = nodes.pop()
                nodes.extend(node.children)
                if node.name == "[memory]":
                    records.append((node.start_time_ns, node.extra_fields))
            held: dict[int, int] = {}
            now = peak = 0
            for _, rec in sorted(records, key=lambda r: r[0]):
                now -= held.pop(rec.ptr, 0)  # freed, or its free went unrecorded
                if rec.alloc_size > 0:
                    held[rec.ptr] = rec.alloc_size
                    now += rec.alloc_size
                peak = max(peak, now)
            tensors = {"buffers": list(ctx.model.buffers())}
            tensors["grads"] = [p for p in ctx.model.parameters() if p.requires_grad]
            sizes = {k: sum(local(t).numel() * local(t).element_size() for t in ts)
                     for k, ts in tensors.items()}  # fmt: skip
            out = ctx.output_dir / f"tensor_peak_rank{ctx.rank}.json"
            # At the end, above the start: the gradients made in the window, and any tensor
            # whose free went unrecorded (its address not used again).
            sizes["held_at_end"] = now
            out.write_text(json.dumps({"above_start": peak, **sizes}))
            self.prof = None


PEAK = ["+callbacks.peak._target_=test_memory_plan.RecordedPeak", "+callbacks.peak.steps=3"]
SHORT = ["trainer.max_steps=5", "trainer.limit_eval_batches=1", "trainer.ckpt_interval=0"]
MLP = ["model.hidden=1024", "model.depth=3"]  # ~34 MiB of training state: above the noise
GPT = ["experiment=text_gpt", "data.block_size=32", "model.n_layer=2", "trainer.batch_size=16"]


def measured_and_planned(tmp_path, *overrides: str) -> tuple[int, memory.MemoryPlan, dict]:
    summary = train_here(tmp_path, *FAST, *SHORT, *PEAK, *overrides)
    peak = json.loads((tmp_path / "tensor_peak_rank0.json").read_text())
    # Parameters and optimizer state (summary.json's state bytes count the gradients too: the
    # profiler counts them again when the next backward makes them) + the peak above them.
    state = summary["state_bytes_per_rank"][0] - peak["grads"]
    measured = state + peak["buffers"] + peak["above_start"]
    cfg = typed(*FAST, *SHORT, *overrides)
    planned = memory.plan_memory(memory.count(cfg, build(cfg.data, "data")), cfg, 1, Wrapper.ddp)
    return measured, planned, summary


@pytest.mark.parametrize(
    "overrides", [MLP, [*GPT, "model.n_embd=64"]], ids=["digits_mlp", "gpt_width64"]
)
def test_plan_is_within_a_quarter_of_the_measured_peak(tmp_path, overrides):
    measured, planned, summary = measured_and_planned(tmp_path, *overrides)
    assert 0.75 <= planned.peak / measured <= 1.25, (planned, measured)
    # summary.json: the plan's sum from what the run held and its own step saved (no step of
    # its own), next to the run's own measure of its peak.
    ran = summary["memory_plan"]
    assert ran["where"] == "run" and ran["batch_size"] == planned.batch_size
    for key in ("params", "grads", "optimizer", "buckets", "gathered"):
        assert ran[key] == getattr(planned, key), key
    assert 0.75 <= ran["activations"] / planned.activations <= 1.25, (ran, planned)
    assert 0.75 <= ran["peak"] / measured <= 1.25, (ran, measured)
    assert summary["memory_peak_measure"] == "cpu_rss_growth"
    assert summary["memory_peak_per_rank"][0] > 0
    assert summary["memory_peak_over_plan"] == summary["memory_peak_per_rank"][0] / ran["peak"]
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["memory_plan"] == ran


@pytest.mark.slow
def test_plan_of_a_wider_gpt_and_the_command(tmp_path):
    measured, planned, _ = measured_and_planned(tmp_path, *GPT, "model.n_embd=192")
    assert 0.75 <= planned.peak / measured <= 1.25, (planned, measured)
    assert planned.activations > planned.params  # the activations matter at this width
    # The command a user types: both wrappers, the largest batch for the memory given.
    out = subprocess.run(
        [sys.executable, "-m", "hydra_ddp.plan", *GPT, "model.n_embd=192", "--ranks", "2",
         "--device-mem", "1GiB"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    lines = {ln[:24].strip(): ln[24:].split() for ln in out.splitlines()[1:]}
    assert lines[""] == ["ddp", "fsdp2"]
    cfg = typed(*GPT, "model.n_embd=192")
    counted = memory.count(cfg, build(cfg.data, "data"))
    ddp, fsdp2 = (memory.plan_memory(counted, cfg, 2, w) for w in (Wrapper.ddp, Wrapper.fsdp2))
    assert fsdp2.optimizer * 2 == pytest.approx(ddp.optimizer, rel=1e-3)
    assert lines["largest batch_size"] == [
        str(ddp.largest_batch(2**30)),
        str(fsdp2.largest_batch(2**30)),
    ]
    assert ddp.at(ddp.largest_batch(2**30)).peak <= 2**30 < ddp.at(
        ddp.largest_batch(2**30) + 1).peak  # fmt: skip
    bad = subprocess.run(
        [sys.executable, "-m", "hydra_ddp.plan", "--device-mem", "lots"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.startswith("error: --device-mem 'lots'")


def test_the_cuda_terms_are_zero_on_cpu_and_follow_torch():
    """The cuBLAS workspaces (memory.py): none on a CPU job, whichever the wrapper; on
    CUDA two (the forward's thread and the backward's), and with PowerSGD one on each of
    torch's 32 pool streams too; CUBLAS_WORKSPACE_CONFIG as torch reads it; the measured
    window runs through PowerSGD's warm-up on CUDA only."""
    digits, powersgd = typed(*FAST), typed(*FAST, "ddp=powersgd")
    for cfg in (digits, powersgd):
        counted = memory.count(cfg, build(cfg.data, "data"))
        for wrapper in Wrapper:
            planned = memory.plan_memory(counted, cfg, 2, wrapper)
            assert planned.workspaces == 0 and planned.where == "cpu"
            assert (planned.hook_state > 0) == (cfg is powersgd and wrapper == Wrapper.ddp)
    assert rules.workspaces(digits, ddp=True) == rules.workspaces(powersgd, ddp=False) == 2
    assert rules.workspaces(powersgd, ddp=True) == 2 + 32
    assert rules.workspace_config(":4096:8") == 32 * 2**20
    assert rules.workspace_config(":4096:2:16:8") == 8 * 2**20 + 128 * 2**10
    assert rules.workspace_config(":0:0") == 0 and rules.workspace_config("") is None
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert rules.window_steps(digits, cuda) == rules.window_steps(powersgd, cpu) == 4
    assert rules.window_steps(powersgd, cuda) == powersgd.ddp.powersgd_start_iter + 33


def test_device_memory_sizes():
    assert parse_bytes("16GiB") == parse_bytes("16G") == parse_bytes("16gb") == 16 * 2**30
    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("1000") == 1000


@pytest.mark.parametrize(
    "args,line",
    [
        (["--ranks", "0"], "error: --ranks 0: give the number of ranks, 1 or more"),
        (["--ranks", "-3"], "error: --ranks -3: give the number of ranks, 1 or more"),
        (["--device-mem", "0"], "error: --device-mem '0' is no memory: give e.g. 16GiB"),
        (["--device-memory", "16GiB"], "error: --device-memory is not an option: the options"),
    ],
)
def test_the_plans_options_refuse_what_plans_nothing(args, line, capsys):
    """A plan for no ranks or no memory printed a table (exit 0); a misspelt option reached
    Hydra as an override it could not parse."""
    from hydra_ddp.plan import main

    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1, err


# The ranks' jobs: text_gpt without its SampleText (under fsdp2 its rank-0-only forward is a
# collective that rank 1 never joins: gloo aborts at the end of the run).
ON_TWO_RANKS = {
    "digits_mlp": MLP,
    "gpt_width64": [*GPT, "~callbacks.sample_text", "model.n_embd=64"],
    "gpt_width192": [*GPT, "~callbacks.sample_text", "model.n_embd=192"],
}


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["default", "fsdp2"])
@pytest.mark.parametrize("job", list(ON_TWO_RANKS))
def test_plan_on_two_ranks(tmp_path, job, wrapper):
    """On 2 gloo ranks: ddp's plan adds its buckets (not in the profiler's window: made at the
    wrap), fsdp2's shards the state and adds the unit-sized buffers it holds at once
    (memory.gathered_bytes)."""
    overrides = [*FAST, *SHORT, *PEAK, *ON_TWO_RANKS[job], f"ddp={wrapper}"]
    summaries = train_ranks(tmp_path, *overrides)
    cfg = typed(*overrides)
    planned = memory.plan_memory(
        memory.count(cfg, build(cfg.data, "data")), cfg, 2, cfg.ddp.wrapper
    )
    ran = summaries[0]["memory_plan"]
    for key in ("params", "grads", "optimizer", "buckets", "gathered"):
        assert ran[key] == pytest.approx(getattr(planned, key), rel=0.01), key
    for rank in (0, 1):
        peak = json.loads((tmp_path / f"tensor_peak_rank{rank}.json").read_text())
        state = summaries[0]["state_bytes_per_rank"][rank] - peak["grads"]
        measured = state + peak["buffers"] + peak["above_start"] + planned.buckets
        assert 0.75 <= planned.peak / measured <= 1.25, (planned, measured, peak)


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["default", "fsdp2"])
def test_a_runs_own_cpu_measure_holds_its_plan(tmp_path, wrapper):
    """summary.json's own check, on 2 gloo ranks, for the GPT of text_gpt at width 256: the
    measured peak (the growth of resident memory over the window, glibc mapping each block above
    128 KiB on its own, tracking/peak.py) within 25 % of the plan. Left to glibc's dynamic
    threshold, which keeps what the backward frees in its heaps, fsdp2's came out 1.35x."""
    summaries = train_ranks(
        tmp_path, *FAST, *SHORT, "experiment=text_gpt", "~callbacks.sample_text",
        "model.n_embd=256", "trainer.max_steps=6", f"ddp={wrapper}",
    )  # fmt: skip
    summary = summaries[0]
    assert summary["memory_peak_measure"] == "cpu_rss_growth"
    assert all(peak > 0 for peak in summary["memory_peak_per_rank"])
    assert 0.75 <= summary["memory_peak_over_plan"] <= 1.25, summary["memory_peak_per_rank"]
