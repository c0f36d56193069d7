"""ddp=fsdp2's options and the template's other parts under it, on real gloo ranks in process
(tests/ranks.py): CPU offload, bf16/fp16 parameters with an fp32 reduce, compile per unit, the
GAN example (two optimizers, a custom step), and a checkpoint refused at save stopping every
rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import FAST
from helpers import ranks
from helpers.inproc import compose, train_ranks

from hydra_ddp.components import build
from hydra_ddp.config import DDPConfig, Wrapper
from hydra_ddp.distributed import fsdp
from hydra_ddp.errors import UserError

GPT = [*FAST, "data=text", "model=gpt", "model.n_layer=2", "model.n_embd=32", "model.n_head=2",
       "model.dropout=0", "data.block_size=32", "trainer.batch_size=8", "trainer.log_interval=1",
       "ddp=fsdp2", "trainer.max_steps=10", "trainer.ckpt_interval=10"]  # fmt: skip


def _losses(job: Path, key: str = "loss") -> dict[int, float]:
    rows = [json.loads(ln) for ln in (job / "stats" / "rank0.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if r.get(key) is not None}


def _dtypes(folder: Path, prefix: str) -> set[torch.dtype]:
    """The dtypes of the tensors under `prefix` (model., optimizer.) in a checkpoint folder,
    as written (DCP's metadata)."""
    meta = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return {
        m.properties.dtype
        for k, m in meta.items()
        if k.startswith(prefix) and isinstance(m, dcp.TensorStorageMetadata)
    }


@pytest.fixture(scope="module")
def fp32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    job = tmp_path_factory.mktemp("fp32") / "job"
    train_ranks(job, *GPT)
    return job


@pytest.mark.slow
def test_cpu_offload_trains_like_the_run_without_it(fp32: Path, tmp_path: Path) -> None:
    """On a CPU job the shards already live in CPU memory, so offloading changes no value: the
    losses are the same to the last bit, through FSDP2's offload path."""
    done = train_ranks(tmp_path / "job", *GPT, "ddp.cpu_offload=true")
    assert "cpu_offload=True" in done.logs[0]
    assert _losses(tmp_path / "job") == _losses(fp32)
    assert sorted(_losses(fp32)) == list(range(1, 11))


@pytest.mark.parametrize(
    "dtype, torch_dtype, autocast",
    [
        ("bf16", torch.bfloat16, False),
        pytest.param("fp16", torch.float16, False, marks=pytest.mark.slow),
        pytest.param("bf16", torch.bfloat16, True, marks=pytest.mark.slow),
    ],
)
def test_low_precision_params_train_with_fp32_state(
    fp32: Path, tmp_path: Path, dtype: str, torch_dtype: torch.dtype, autocast: bool
) -> None:
    """The forward and backward compute in bf16/fp16 (the gathered parameters), the gradients
    are reduced in fp32, and what the optimizer steps and the checkpoint keeps stays fp32.
    Tolerance: a bf16 value keeps 8 bits of mantissa (a relative rounding of up to 2^-8 =
    0.4 % per weight and activation), fp16 11 (0.05 %); the loss averages many such roundings,
    and the fp32 master weights take every update, so nothing compounds over 10 steps. Bound:
    one rounding's worth, 0.5 % (bf16) and 0.05 % (fp16) of the fp32 run's loss (measured:
    0.017 % and 0.0008 %); the losses still differ from fp32's (the policy did apply). Under
    autocast (trainer.precision=bf16) the units inside the root do not cast their inputs
    (autocast casts each op's); without it they must (a 16-bit unit fed fp32 would fail)."""
    job = tmp_path / "job"
    precision = f"trainer.precision={'bf16' if autocast else 'fp32'}"
    done = train_ranks(job, *GPT, f"ddp.param_dtype={dtype}", "ddp.reduce_dtype=fp32", precision)
    assert f"param_dtype={dtype} reduce_dtype=fp32" in done.logs[0]
    assert f"units_cast_inputs={not autocast}" in done.logs[0]
    low, full = _losses(job), _losses(fp32)
    assert sorted(low) == sorted(full) == list(range(1, 11))
    rel = 5e-3 if dtype == "bf16" else 5e-4
    for step in full:
        assert low[step] == pytest.approx(full[step], rel=rel), (step, low[step], full[step])
    assert low != full, "the losses equal fp32's: the parameters were not cast"
    # What the optimizer holds and the checkpoint keeps: fp32 shards, fp32 Adam moments.
    ckpt = job / "checkpoints" / "step_00000010.dcp"
    assert _dtypes(ckpt, "model.") == {torch.float32}
    assert _dtypes(ckpt, "optimizer.") == {torch.float32}
    assert torch_dtype not in _dtypes(ckpt, "")


def _units_after_wrap(env, overrides: list[str]) -> dict[str, list[str]]:
    """On a rank: the GPT example built and sharded with compile_units=True, as the loop does
    for trainer.compile=true under ddp=fsdp2; which modules came out compiled and sharded."""
    from torch.distributed.fsdp import FSDPModule

    cfg = compose(*overrides)
    model = build(cfg.model, "model", vocab_size=65, block_size=32)
    ddp = DDPConfig(wrapper=Wrapper.fsdp2)
    fsdp.wrap(model, env, ddp, compile_units=True)
    seen: dict[str, list[str]] = {"compiled": [], "sharded": []}
    for name, module in model.named_modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            seen["compiled"].append(name or "<root>")
        if isinstance(module, FSDPModule):
            seen["sharded"].append(name or "<root>")
    return seen


def test_compile_makes_each_unit_compiled_and_sharded() -> None:
    """trainer.compile=true under ddp=fsdp2 compiles each unit (the GPT's blocks) on its own,
    before it is sharded, and not the root: its all-gathers and reduce-scatters stay in FSDP2's
    hooks, outside the compiled graphs. Checked on the modules, not by running them: inductor
    compiling on a 2-core CPU box takes minutes (the real run: the slow test below)."""
    seen = ranks.run(_units_after_wrap, ["model=gpt", "model.n_layer=2", "model.n_embd=32",
                                         "model.n_head=2"], world_size=2)  # fmt: skip
    for rank in seen:
        assert rank["compiled"] == ["blocks.0", "blocks.1"], rank
        assert rank["sharded"] == ["<root>", "blocks.0", "blocks.1"], rank


@pytest.mark.slow
def test_gan_example_trains_under_fsdp2_as_under_ddp(tmp_path: Path) -> None:
    """experiment=gan (two optimizers, each clipped to its own threshold, a custom step that
    alternates them, gradient accumulation) under ddp=fsdp2: the same losses as under DDP."""
    gan = [*FAST, "experiment=gan", "trainer.max_steps=20", "trainer.log_interval=5",
           "trainer.grad_accum=2"]  # fmt: skip
    train_ranks(tmp_path / "ddp", *gan)
    train_ranks(tmp_path / "fsdp2", *gan, "ddp=fsdp2")
    for key in ("loss", "loss_d", "loss_g"):
        a, b = _losses(tmp_path / "ddp", key), _losses(tmp_path / "fsdp2", key)
        assert sorted(a) == sorted(b) == [5, 10, 15, 20]
        assert max(abs(a[s] - b[s]) for s in a) < 1e-5, (key, a, b)


def test_unloadable_callback_state_stops_every_rank_with_one_line(tmp_path: Path) -> None:
    """A callback state weights_only cannot load is refused at the first save: rank 0 alone
    holds it, yet every rank stops with the same line (none waits in a collective for rank
    0), and no checkpoint folder, whole or partial, is left."""
    job = [*GPT, "trainer.max_steps=4", "trainer.ckpt_interval=2",
           "+callbacks.odd._target_=helpers.state_callbacks.OpaqueState"]  # fmt: skip
    errors = train_ranks(tmp_path, *job, return_exceptions=True, timeout=120)
    assert [type(e) for e in errors] == [UserError, UserError], errors
    assert str(errors[0]) == str(errors[1]) and "\n" not in str(errors[0])
    assert str(errors[0]).startswith("callbacks.odd: state_dict()['thing'] holds")
    assert not list(tmp_path.glob("checkpoints/*"))


@pytest.mark.slow  # inductor compiling two blocks on 2 CPU ranks: ~2 minutes here
def test_compiled_units_train_like_eager(tmp_path: Path) -> None:
    """trainer.compile=true under ddp=fsdp2, really compiled (inductor, CPU): the same losses as
    the eager run to float rounding (inductor fuses and reorders the float ops)."""
    short = [*GPT, "trainer.max_steps=3", "trainer.ckpt_interval=0"]
    train_ranks(tmp_path / "eager", *short)
    train_ranks(tmp_path / "compiled", *short, "trainer.compile=true", timeout=600)
    a, b = _losses(tmp_path / "eager"), _losses(tmp_path / "compiled")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert max(abs(a[s] - b[s]) for s in a) < 1e-4, (a, b)
