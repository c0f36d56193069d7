"""ddp=fsdp2: the model sharded with fully_shard, and its sharded checkpoints (dcp.py).

On real gloo ranks in process (helpers/ranks.py): FSDP2 against DDP on the same seed (losses and
final parameters equal, about half the state per rank), the sharded checkpoints (resume on 2,
then 1, then 2 ranks equal to an uninterrupted run; integrity, fallback, rotation, export,
init_from both ways), and every bad input in one line before any step. Real torchrun jobs
(slow): exit 0 with no abort at teardown, `hydra_ddp.eval` reproducing the run's test loss, and
a SIGKILLed rank restarted by --max-restarts=1 ending where an uninterrupted run ends.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import FAST, ok, only_job_dir, run, summary, torchrun, user_env
from helpers.inproc import compose, train_here, train_ranks, typed
from helpers.runs import assert_close, final_weights, global_losses, losses
from omegaconf import OmegaConf

from hydra_ddp import checkpoint
from hydra_ddp.errors import UserError
from hydra_ddp.export.writer import export

GPT = [
    *FAST,
    "data=text",
    "model=gpt",
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "model.dropout=0",
    "data.block_size=32",
    "trainer.batch_size=8",
    "trainer.log_interval=1",
]


# --------------------------------------------------------------------------------------------
# FSDP2 against DDP
# --------------------------------------------------------------------------------------------

SAME_AS_DDP = [*GPT, "trainer.max_steps=50", "trainer.grad_accum=2", "trainer.grad_clip=0.5",
               "trainer.log_interval=5"]  # fmt: skip


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same 2-rank job under DDP and under FSDP2 (fp32, grad_accum=2, clipping); fsdp2
    writes its periodic checkpoints in the background (trainer.async_ckpt)."""
    root = tmp_path_factory.mktemp("pair")
    jobs = {"ddp": root / "ddp", "fsdp2": root / "fsdp2"}
    train_ranks(jobs["ddp"], *SAME_AS_DDP, timeout=300)
    fsdp2 = [*SAME_AS_DDP, "ddp=fsdp2", "trainer.ckpt_interval=10", "trainer.keep_ckpts=3",
             "trainer.async_ckpt=true"]  # fmt: skip
    train_ranks(jobs["fsdp2"], *fsdp2, timeout=300)
    # What Hydra writes for a run of the CLI, which the export rebuilds the model from.
    (jobs["fsdp2"] / ".hydra").mkdir()
    OmegaConf.save(compose(*fsdp2), jobs["fsdp2"] / ".hydra" / "config.yaml")
    return jobs


def test_fsdp2_matches_ddp_with_half_the_state(pair: dict[str, Path]) -> None:
    """Loss curves and final parameters (the export's) equal to 1e-5; state per rank ~1/2."""
    la, lb = losses(pair["ddp"]), losses(pair["fsdp2"])
    assert sorted(la) == sorted(lb) == list(range(5, 51, 5))
    assert max(abs(la[s] - lb[s]) for s in la) < 1e-5
    exported = export(pair["fsdp2"])  # assembled on the CPU from the sharded checkpoint
    assert exported == pair["fsdp2"] / "export" / "step_00000050"
    plain = checkpoint.load(exported)
    assert plain["step"] == 50
    assert_close(plain["model"], final_weights(pair["ddp"]), atol=1e-5)
    # Every job records its state bytes; fsdp2's are about half of DDP's on 2 ranks (the
    # remainder: shards padded to equal size, AdamW's unsharded step counters).
    ddp_bytes = summary(pair["ddp"])["state_bytes_per_rank"]
    fsdp_bytes = summary(pair["fsdp2"])["state_bytes_per_rank"]
    assert ddp_bytes[0] == ddp_bytes[1]
    for b in fsdp_bytes:
        assert 0.45 * ddp_bytes[0] < b < 0.55 * ddp_bytes[0], (fsdp_bytes, ddp_bytes)


def test_sharded_checkpoints_rotate_and_fall_back_past_a_damaged_one(
    pair: dict[str, Path], tmp_path: Path
) -> None:
    job = tmp_path / "job"
    shutil.copytree(pair["fsdp2"], job)
    folder = job / "checkpoints"
    steps = sorted(p.name for p in folder.glob("step_*"))
    assert steps == ["step_00000030.dcp", "step_00000040.dcp", "step_00000050.dcp"]  # keep 3
    assert (folder / "best.dcp").is_dir() and not list(folder.glob(".*"))
    newest = folder / "step_00000050.dcp"
    assert checkpoint.latest(job) == newest
    # Written in the background, completed at the next save: whole, and at its own step.
    assert checkpoint.load(folder / "step_00000040.dcp")["step"] == 40
    # A half-written save (killed mid-write) has no checkpoint's name: never picked.
    shutil.copytree(newest, folder / ".step_00000060.dcp.tmp")
    assert checkpoint.latest(job) == newest
    # One flipped byte in a shard: the newest is skipped for the one before.
    shard = next(newest.glob("__1_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert "CRC" in checkpoint.why_not_whole(newest)
    assert checkpoint.latest(job) == folder / "step_00000040.dcp"
    (folder / "step_00000040.dcp" / "manifest.json").unlink()  # its write never completed
    assert checkpoint.latest(job) == folder / "step_00000030.dcp"
    with pytest.raises(UserError, match="not a readable checkpoint.*CRC"):
        checkpoint.load(newest)


@pytest.mark.slow  # a real launch; the default suite keeps to 5 minutes
def test_init_from_across_ddp_and_fsdp2(pair: dict[str, Path], tmp_path: Path) -> None:
    """A DDP job starts from an fsdp2 run's sharded checkpoint, and an fsdp2 job from a DDP
    run's file: the first step's loss is the loss of the weights loaded, on both."""
    short = [*GPT, "trainer.max_steps=1", "optim.lr=0"]
    into_ddp = train_ranks(tmp_path / "a", *short, f"trainer.init_from={pair['fsdp2']}")[0]
    into_fsdp = train_ranks(
        tmp_path / "b", *short, "ddp=fsdp2", f"trainer.init_from={pair['ddp']}"
    )[0]
    # ddp.meta_init: loaded into the shards, not into a whole model per rank (each rank reads
    # its own slices of the file's tensors; a .dcp folder's own parts only, through DCP).
    meta = [*short, "ddp=fsdp2", "ddp.meta_init=true"]
    meta_from_file = train_ranks(tmp_path / "c", *meta, f"trainer.init_from={pair['ddp']}")
    meta_from_dcp = train_ranks(tmp_path / "d", *meta, f"trainer.init_from={pair['fsdp2']}")
    for done in (meta_from_file, meta_from_dcp):
        assert "29 matched, 0 missing, 0 unexpected, 0 reshaped-refused" in done.logs[0]
    # lr 0: the weights stay as loaded, and evaluate to the test loss of the run they came from.
    for done, source in ((into_ddp, "fsdp2"), (into_fsdp, "ddp"), (meta_from_file[0], "ddp"),
                         (meta_from_dcp[0], "fsdp2")):  # fmt: skip
        assert done["test_loss"] == pytest.approx(summary(pair[source])["test_loss"], abs=1e-5)


# --------------------------------------------------------------------------------------------
# Another number of ranks
# --------------------------------------------------------------------------------------------


@pytest.mark.slow  # four runs
def test_resume_on_2_then_1_then_2_ranks_continues_the_run(tmp_path: Path) -> None:
    """2 ranks x 8 rows to step 10, 1 rank x 16 rows to step 20, 2 ranks x 8 to step 30: the
    same global batches as an uninterrupted 2-rank run (the strided order is global), so the
    same losses and final parameters; the step count continues across the changes."""
    # A constant rate: the schedule does not depend on trainer.max_steps, which differs here.
    common = [*GPT, "ddp=fsdp2", "trainer.ckpt_interval=10", "trainer.ema_decay=0.9",
              "scheduler=constant", "scheduler.warmup_steps=0"]  # fmt: skip
    base = tmp_path / "base"
    train_ranks(base, *common, "trainer.max_steps=30", timeout=300)
    job = tmp_path / "job"
    train_ranks(job, *common, "trainer.max_steps=10")
    one = train_here(job, *common, "trainer.max_steps=20", "trainer.batch_size=16")
    assert one["steps"] == 20 and one["steps_this_run"] == 10 and one["world_size"] == 1
    two = train_ranks(job, *common, "trainer.max_steps=30")[0]
    assert two["steps"] == 30 and two["steps_this_run"] == 10
    la, lb = global_losses(job), global_losses(base)
    assert sorted(la) == list(range(1, 31))
    assert max(abs(la[s] - lb[s]) for s in la) < 1e-4
    assert_close(final_weights(job), final_weights(base), atol=1e-5)
    assert two["test_loss"] == pytest.approx(summary(base)["test_loss"], abs=1e-5)  # via EMA


# --------------------------------------------------------------------------------------------
# Bad input: one line, before any step
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_meta_init_draws_each_shard_of_its_own(tmp_path: Path) -> None:
    """ddp.meta_init on 2 ranks: the randomly initialised weights, gathered whole (lr 0: the
    one step changes nothing), have halves that differ: no rank's shard is a copy of
    another's."""
    run_dir = tmp_path / "meta"
    train_ranks(run_dir, *GPT, "ddp=fsdp2", "ddp.meta_init=true", "trainer.max_steps=1",
                "optim.lr=0")  # fmt: skip
    drawn = {k: w for k, w in final_weights(run_dir).items() if w.dim() == 2 and w.std() > 0}
    assert drawn, "no randomly initialised weight found"
    for name, w in drawn.items():
        half = w.shape[0] // 2
        assert not torch.equal(w[:half], w[half : 2 * half]), f"{name}: both shards drew alike"


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["ddp=fsdp2", "ddp.bucket_cap_mb=50"], r"ddp.bucket_cap_mb=50.0: a Distrib.*ddp.shard_u"),
        (["ddp=fsdp2", "ddp.comm_hook=powersgd"], r"ddp.comm_hook=powersgd: a Distrib"),
        (["ddp.reshard_after_forward=false"], r"option of ddp=fsdp2.*add ddp=fsdp2"),
        (["trainer.async_ckpt=true"], r"trainer.async_ckpt=true needs ddp=fsdp2"),
    ],
)
def test_options_of_the_other_wrapper_are_refused(overrides: list[str], match: str) -> None:
    with pytest.raises(UserError, match=match):
        typed(*overrides)


def test_units_that_match_no_module_are_refused_naming_what_exists(tmp_path: Path) -> None:
    done = train_ranks(
        tmp_path / "job", *GPT, "ddp=fsdp2", "ddp.shard_units=[Blocks]", "trainer.max_steps=2",
        return_exceptions=True,
    )  # fmt: skip
    for e in done:
        assert isinstance(e, UserError), e
        line = str(e)
        assert "\n" not in line and "'Blocks' matches no module of GPT" in line
        assert "Block," in line and "blocks" in line
    assert not (tmp_path / "job" / "stats" / "rank0.jsonl").exists()  # no step ran


def test_a_ddp_checkpoint_is_not_resumed_as_sharded(pair: dict[str, Path], tmp_path: Path) -> None:
    job = tmp_path / "job"
    shutil.copytree(pair["ddp"], job)
    done = train_ranks(job, *SAME_AS_DDP, "ddp=fsdp2", return_exceptions=True)
    for e in done:
        assert isinstance(e, UserError) and "trainer.init_from=" in str(e), e


# --------------------------------------------------------------------------------------------
# Real torchrun jobs
# --------------------------------------------------------------------------------------------


@pytest.mark.slow  # three real torchrun jobs and three real eval/export commands
def test_torchrun_fsdp2_exits_cleanly_and_eval_reproduces_its_test_loss(tmp_path: Path) -> None:
    args = [*GPT, "ddp=fsdp2", "trainer.max_steps=6", "trainer.log_interval=3"]
    for i in range(3):  # the abort at teardown came ~1 in 3 runs
        proc = ok(torchrun(tmp_path, *args, f"hydra.run.dir=outputs/run{i}", timeout=300))
        assert "SIGABRT" not in proc.stderr and "Aborted" not in proc.stderr
    job = tmp_path / "outputs" / "run0"
    assert (job / "checkpoints" / "step_00000006.dcp" / "manifest.json").is_file()
    test_loss = summary(job)["test_loss"]
    evaluate = [sys.executable, "-m", "hydra_ddp.eval", f"run={job}"]
    for extra in ([], ["ckpt=best", "dist.nproc_per_node=2"]):
        ok(run([*evaluate, *extra], tmp_path, timeout=300))
        assert json.loads((job / "eval_test.json").read_text())["loss"] == pytest.approx(
            test_loss, abs=1e-6
        )
    ok(run([sys.executable, "-m", "hydra_ddp.export", f"run={job}", "out=w"], tmp_path))
    ok(run([sys.executable, "-m", "hydra_ddp.eval", f"run={job}", f"ckpt={tmp_path / 'w'}"],
           tmp_path, timeout=300))  # fmt: skip
    assert json.loads((job / "eval_test.json").read_text())["loss"] == pytest.approx(test_loss)


@pytest.mark.slow  # a real SIGKILL and a real torchrun restart
def test_sigkilled_rank_under_max_restarts_ends_like_an_uninterrupted_run(tmp_path: Path) -> None:
    args = [*GPT, "ddp=fsdp2", "trainer.max_steps=40", "trainer.ckpt_interval=10",
            "trainer.log_interval=10"]  # fmt: skip
    base = tmp_path / "base"
    train_ranks(base, *args, timeout=300)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--max-restarts=1", "-m", "hydra_ddp.train", *args]  # fmt: skip
    with open(tmp_path / "launcher.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=user_env(tmp_path), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not list(tmp_path.glob("outputs/*/*/checkpoints/step_*.dcp")):
            assert proc.poll() is None and time.monotonic() < deadline, "no first checkpoint"
            time.sleep(0.05)
        worker = next(
            p
            for p in psutil.Process(proc.pid).children(recursive=True)
            if p.environ().get("LOCAL_RANK") == "1"
        )
        worker.send_signal(signal.SIGKILL)
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            for p in psutil.Process(proc.pid).children(recursive=True):
                p.kill()
            proc.kill()
    out = (tmp_path / "launcher.log").read_text()
    assert rc == 0, out[-4000:]
    assert "resumed from" in out, out[-3000:]
    job = only_job_dir(tmp_path)
    assert summary(job)["steps"] == 40
    assert_close(final_weights(job), final_weights(base), atol=1e-6)
