"""Bad input: one clear short error, before anything is trained or overwritten.

Every case of the table runs, in process, what `python -m hydra_ddp.train ...` runs up to the
point where the case fails: the config composed with Hydra's compose API (a composition error is
Hydra's own), typed with every check (`to_typed`), the launcher variables read, then `preflight`
when the job would start 2 workers and the workers' `train` on 2 real gloo ranks (helpers/ranks.py),
or `train` on one rank here. Each must fail with a `UserError` of one line holding the expected
text. A scratch dir holds an earlier run's outputs, and each case checks they were left exactly as
they were and that the malicious checkpoint was never unpickled.

Two real CLI runs check what the entry makes of a UserError end to end: exit status 2, one
`error:` line, no traceback; one in a single process (a refused resume, which also keeps the
earlier run's .hydra record), one self-launched with dist.nproc_per_node=2 (a preflight error in
the launching process, before any worker starts).

Two checks cannot run here as they would for a user: more processes per node than GPUs (this
machine has no GPU; `dist._pick_device` with torch.cuda's two queries monkeypatched, the one
patch in these tests), and torchrun's own failure report (slow: torchrun prints a ChildFailedError
traceback of its own whenever a worker exits non-zero; the test checks that ours is the one-line
error and that no frame of that traceback is ours).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch
from conftest import FAST, REPO, TESTS, make_synthetic, python_train, torchrun, user_env
from helpers import ranks
from helpers.inproc import compose, entry, entry_on_a_rank, train_here
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from hydra_ddp.errors import UserError

pytestmark = pytest.mark.timeout(600)

PREV = Path("outputs") / "2000-01-01" / "00-00-00"  # the earlier run, relative to its folder
MARKER = "PWNED"  # what the malicious checkpoint would create if it were ever unpickled
SMALL = [*FAST, "trainer.max_steps=3", "trainer.batch_size=16"]


# --------------------------------------------------------------------------------------------
# Fixtures: an earlier run, data sets and checkpoints, built once per module
# --------------------------------------------------------------------------------------------


class _Evil:
    """Unpickling this would run a shell command; weights_only loading must refuse it."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _hydra_record(job: Path, overrides: list[str]) -> None:
    """What Hydra writes into .hydra/ for a run: the composed config and the overrides."""
    (job / ".hydra").mkdir(parents=True)
    OmegaConf.save(compose(*overrides), job / ".hydra" / "config.yaml")
    OmegaConf.save(OmegaConf.create(overrides), job / ".hydra" / "overrides.yaml")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad_input")
    # An earlier run, real: logs, stats, checkpoints, summary.json, and its .hydra record.
    earlier = root / "earlier"
    job = earlier / PREV
    first = [*SMALL, "trainer.ckpt_interval=2"]
    train_here(job, *first)
    _hydra_record(job, first)
    good_ckpt = sorted((job / "checkpoints").glob("step_*.pt"))[-1]

    files: dict[str, Path] = {"earlier": earlier, "good_ckpt": good_ckpt}
    data = root / "data"
    for name, args in [
        ("syn1", ["--rows", "1", "--shards", "1", "--eval-rows", "4"]),
        ("syn", ["--rows", "64", "--shards", "1", "--eval-rows", "8", "--features", "8"]),
    ]:
        files[name] = make_synthetic(data / name, *args)
    for name in ("bad_manifest", "missing_shard", "corrupt_shard"):
        shutil.copytree(data / "syn", data / name)
        files[name] = data / name
    (data / "bad_manifest" / "manifest.json").write_text('{"features": 8, "splits": ')
    (data / "missing_shard" / "train_00000.x.npy").unlink()
    (data / "corrupt_shard" / "train_00000.x.npy").write_bytes(os.urandom(300))
    files["no_data"] = data / "does-not-exist"

    ckpts = root / "ckpts"
    ckpts.mkdir()
    blob = good_ckpt.read_bytes()
    (ckpts / "truncated.pt").write_bytes(blob[: len(blob) // 2])
    (ckpts / "garbage.pt").write_bytes(np.random.default_rng(0).bytes(4096))
    (ckpts / "empty.pt").write_bytes(b"")
    (ckpts / "empty_dir").mkdir()
    state = torch.load(good_ckpt, weights_only=True)
    state["payload"] = _Evil(str(root / MARKER))
    torch.save(state, ckpts / "evil.pt")
    files.update({n: ckpts / f"{n}.pt" for n in ("truncated", "garbage", "empty", "evil")})
    files["empty_dir"] = ckpts / "empty_dir"
    files["missing_ckpt"] = ckpts / "step_00000099.pt"
    files["marker"] = root / MARKER
    return files


def _snapshot(folder: Path) -> dict[str, tuple[int, str]]:
    return {
        str(p.relative_to(folder)): (
            p.stat().st_mtime_ns,
            hashlib.sha256(p.read_bytes()).hexdigest(),
        )
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def cwd(tmp_path: Path, world: dict[str, Path]) -> Path:
    """A scratch dir holding a copy of the earlier run's outputs (mtimes kept)."""
    shutil.copytree(world["earlier"] / "outputs", tmp_path / "outputs")
    return tmp_path


@pytest.fixture
def busy_port():
    """A TCP port some other program is listening on."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


# --------------------------------------------------------------------------------------------
# The table, in process
# --------------------------------------------------------------------------------------------


@dataclass
class Case:
    id: str
    overrides: list[str]
    expect: list[str]  # substrings of the error, all required
    env: dict[str, Optional[str]] = field(default_factory=dict)
    # 1: an error of Hydra's composition, checked here through Hydra's compose API (the CLI
    # says it in one line before Hydra runs: tests/test_vars_and_override_grammar.py); else 2.
    exit_code: Optional[int] = None
    skip_if_cuda: bool = False
    slow: bool = False  # a real launch or a timeout to wait out: in the slow set


# {name} in an override or env value is replaced by world[name] (a path) or the busy port.
CASES = [
    # Composition (Hydra's own errors).
    Case(
        "unknown_group_choice", ["model=nope"], ["Could not find 'model/nope'", "mlp"], exit_code=1
    ),
    Case("unknown_sampler", ["sampler=nope"], ["Could not find 'sampler/nope'"], exit_code=1),
    Case("unknown_key", ["trainer.batchsize=8"], ["trainer.batchsize"], exit_code=1),
    Case(
        "wrong_type_int",
        ["trainer.batch_size=abc"],
        ["trainer.batch_size", "could not be converted to Integer"],
        exit_code=1,
    ),
    Case("wrong_enum_value", ["sampler.policy=random"], ["sampler.policy", "random"], exit_code=1),
    # Validation (__post_init__ -> UserError, exit 2).
    Case(
        "zero_batch_size",
        ["trainer.batch_size=0"],
        ["trainer.batch_size=0 is not allowed", "> 0"],
        exit_code=2,
    ),
    Case("negative_batch_size", ["trainer.batch_size=-8"], ["trainer.batch_size=-8"], exit_code=2),
    Case("negative_max_steps", ["trainer.max_steps=-5"], ["trainer.max_steps=-5"], exit_code=2),
    Case("zero_epochs", ["trainer.epochs=0"], ["trainer.epochs=0"], exit_code=2),
    Case("zero_hidden", ["model.hidden=0"], ["model.hidden=0"], exit_code=2),
    Case("dropout_one", ["model.dropout=1.0"], ["model.dropout=1.0", "[0, 1)"], exit_code=2),
    Case(
        "model_argument_typo",
        ["+model.hiddden=8"],
        ["model.hiddden is not an argument of hydra_ddp.models.MLP", "hidden"],
        exit_code=2,
    ),
    Case(
        "negative_lr", ["optim.lr=-1"], ["optim (torch.optim.AdamW)", "learning rate"], exit_code=2
    ),
    Case("lr_not_a_number", ["optim.lr=abc"], ["optim.lr='abc' is not a number"], exit_code=2),
    Case("bucket_cap_zero", ["ddp.bucket_cap_mb=0"], ["ddp.bucket_cap_mb=0", "> 0"], exit_code=2),
    Case("bucket_cap_negative", ["ddp.bucket_cap_mb=-1"], ["ddp.bucket_cap_mb=-1.0"], exit_code=2),
    Case("timeout_zero", ["dist.timeout_s=0"], ["dist.timeout_s=0"], exit_code=2),
    Case("nproc_zero", ["dist.nproc_per_node=0"], ["dist.nproc_per_node=0"], exit_code=2),
    Case("keep_ckpts_zero", ["trainer.keep_ckpts=0"], ["trainer.keep_ckpts=0"], exit_code=2),
    Case(
        "fractions_over_one",
        ["data.val_fraction=0.6", "data.test_fraction=0.5"],
        ["data.val_fraction + data.test_fraction"],
        exit_code=2,
    ),
    Case(
        "fp16_on_cpu",
        ["trainer.precision=fp16", "dist.device=cpu"],
        ["trainer.precision=fp16 needs CUDA"],
        exit_code=2,
    ),
    Case(
        "cuda_without_gpu",
        ["dist.device=cuda"],
        ["dist.device=cuda", "CUDA is not available"],
        exit_code=2,
        skip_if_cuda=True,
    ),
    Case(
        "partial_launcher_env",
        [],
        ["RANK", "not", "start the job with torchrun"],
        env={"RANK": "0"},
        exit_code=2,
    ),
    Case(
        "unknown_monitor",
        ["trainer.monitor=val/nope"],
        ["trainer.monitor=val/nope", "val/loss, val/acc"],
        exit_code=2,
    ),
    # Models and data.
    Case(
        "model_target_missing",
        ["model._target_=nowhere.Model"],
        ["model._target_='nowhere.Model' cannot be imported"],
        exit_code=2,
    ),
    Case(
        "cnn_on_flat_data",
        ["data=synthetic", "data.path={syn}", "model=cnn"],
        ["model (hydra_ddp.models.CNN) needs image_shape", "in_features, out_features"],
        exit_code=2,
    ),
    Case(
        "gpt_on_digits",
        ["model=gpt"],
        ["model (hydra_ddp.models.GPT) needs vocab_size"],
        exit_code=2,
    ),
    Case(
        "data_dir_missing",
        ["data=synthetic", "data.path={no_data}"],
        ["manifest.json not found", "make_synthetic.py"],
        exit_code=2,
    ),
    Case(
        "manifest_corrupt",
        ["data=synthetic", "data.path={bad_manifest}"],
        ["is not a valid manifest"],
        exit_code=2,
    ),
    Case(
        "shard_file_missing",
        ["data=synthetic", "data.path={missing_shard}"],
        ["train_00000.x.npy is missing"],
        exit_code=2,
    ),
    Case(
        "shard_file_corrupt",
        ["data=synthetic", "data.path={corrupt_shard}"],
        ["train_00000.x.npy is not a readable .npy file"],
        exit_code=2,
    ),
    Case(
        "sharded_fewer_rows_than_ranks",
        ["data=synthetic", "data.path={syn1}", "sampler=sharded", "dist.nproc_per_node=2"],
        ["sampler=sharded needs at least one training row per rank", "1 rows for 2 ranks"],
        exit_code=2,
    ),
    Case(
        "shard_by_files_fewer_files_than_ranks",
        [
            "data=synthetic",
            "data.path={syn}",
            "sampler=sharded",
            "sampler.shard_by=files",
            "dist.nproc_per_node=2",
        ],
        ["sampler.shard_by=files needs at least one file per rank"],
        exit_code=2,
    ),
    # Resuming.
    Case(
        "resume_missing",
        ["trainer.resume={missing_ckpt}"],
        ["trainer.resume=", "step_00000099.pt: no such file"],
        exit_code=2,
    ),
    Case(
        "resume_empty_dir",
        ["trainer.resume={empty_dir}"],
        ["holds no complete checkpoint"],
        exit_code=2,
    ),
    Case(
        "resume_truncated",
        ["trainer.resume={truncated}"],
        ["truncated.pt is not a readable checkpoint", "trainer.resume=never"],
        exit_code=2,
    ),
    Case(
        "resume_garbage",
        ["trainer.resume={garbage}"],
        ["garbage.pt is not a readable checkpoint"],
        exit_code=2,
    ),
    Case("resume_empty_file", ["trainer.resume={empty}"], ["empty.pt is empty"], exit_code=2),
    Case(
        "resume_code_in_pickle",
        ["trainer.resume={evil}"],
        ["refusing to load", "evil.pt", "would run code", "posix.system"],
        exit_code=2,
    ),
    Case(
        "resume_other_model",
        ["trainer.resume={good_ckpt}", "model.hidden=64"],
        ["is a checkpoint of a different model", "size mismatch", "trainer.resume=never"],
        exit_code=2,
    ),
    # Distributed setup: the first two fail in the 2 workers, after the process group is up.
    Case(
        "unused_params_without_find_unused",
        ["model._target_=helpers.unused_model.MLPWithUnusedHead", "dist.nproc_per_node=2"],
        ["got no gradient", "ddp=unused_params"],
        exit_code=2,
        slow=True,
    ),
    Case(
        "ddp_none_with_two_ranks",
        ["ddp=none", "dist.nproc_per_node=2"],
        ["ddp=none", "diverging copy"],
        exit_code=2,
        slow=True,  # starts 2 workers; the self-launch's preflight errors are in the default set
    ),
    Case(
        "rendezvous_port_in_use",
        ["dist.timeout_s=20"],
        ["port {port} is already in use", "MASTER_PORT"],
        env={
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "{port}",
        },
        exit_code=2,
        slow=True,  # waits out a timeout; test_faults.py's busy-port launch is slow too
    ),
    Case(
        "wandb_shared_offline",
        ["logger=wandb", "logger.layout=shared", "logger.mode=offline"],
        ["logger.layout=shared needs W&B online", "logger.layout=gather"],
        exit_code=2,
    ),
]


def _fill(text: str, world: dict[str, Path], port: int) -> str:
    return text.format(port=port, **{k: str(v) for k, v in world.items()})


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.id, marks=[pytest.mark.slow] * c.slow) for c in CASES]
)
def test_bad_input_fails_cleanly(
    case: Case,
    tmp_path: Path,
    world: dict[str, Path],
    busy_port: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if case.skip_if_cuda and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    earlier = world["earlier"] / PREV
    before = _snapshot(earlier)
    overrides = [*SMALL, *(_fill(o, world, busy_port) for o in case.overrides)]
    env = {k: _fill(v, world, busy_port) for k, v in case.env.items()}
    out = tmp_path / "job"
    if case.exit_code == 1:
        with pytest.raises(ConfigCompositionException) as info:
            compose(*overrides)
        # Hydra's message and its cause, as the CLI prints them.
        causes, e = [], info.value
        while e is not None:
            causes.append(str(e))
            e = e.__cause__
        message = "\n".join(causes)
    else:
        with pytest.raises(UserError) as info:
            if "MASTER_PORT" in env:
                ranks.run(entry_on_a_rank, out, overrides, world_size=1, group=False, env=env)
            else:
                for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
                    monkeypatch.delenv(key, raising=False)
                for key, value in env.items():
                    monkeypatch.setenv(key, value)
                entry(out, *overrides)
        message = str(info.value)
        assert "\n" not in message and len(message) < 800, message
    for want in case.expect:
        assert _fill(want, world, busy_port) in message, f"missing {want!r} in {message!r}"
    assert _snapshot(earlier) == before, "the earlier run's outputs were touched"
    assert not world["marker"].exists(), "the malicious checkpoint was unpickled"


def test_more_processes_per_node_than_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine has no GPU, so the check is called directly with torch.cuda's two queries
    patched to report 2 GPUs: the only patch in these tests, and it touches no
    torch.distributed code."""
    from hydra_ddp.config import Device, DistConfig
    from hydra_ddp.distributed.env import _pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = DistConfig(device=Device.auto)
    assert _pick_device(cfg, local_rank=1) == torch.device("cuda", 1)
    with pytest.raises(UserError) as err:
        _pick_device(cfg, local_rank=2)
    msg = str(err.value)
    assert "local rank 2 has no GPU" in msg and "2 visible GPU(s)" in msg
    assert "--nproc_per_node" in msg and "at most 2" in msg
    assert _pick_device(DistConfig(device=Device.cpu), local_rank=5) == torch.device("cpu")


# --------------------------------------------------------------------------------------------
# The two real CLI runs
# --------------------------------------------------------------------------------------------


def _one_error_line(proc, procs: int = 1) -> str:
    """Exit 2, no traceback (nor C++ stack), one short `error:` line; that line."""
    out = proc.stdout + proc.stderr
    report = f"exit {proc.returncode}\n--- output\n{out[-5000:]}"
    assert proc.returncode == 2, report
    assert "Traceback" not in out, report
    assert "frame #" not in out, report
    errors = [ln for ln in out.splitlines() if "error:" in ln]
    assert len(errors) == 1, f"want one error line\n{report}"
    assert len(errors[0]) < 800, f"error line too long\n{report}"
    return errors[0]


@pytest.mark.slow  # the refusals themselves: the resume_* cases above, in process
def test_cli_refused_resume_is_one_line_exit_2_and_keeps_the_record(
    cwd: Path, world: dict[str, Path]
) -> None:
    """`python -m hydra_ddp.train model=cnn hydra.run.dir=<an MLP run>` in a folder holding an
    earlier run: the resume (trainer.resume=auto) is refused in one line, exit 2.

    Previously the refused run replaced the dir's `.hydra/config.yaml` and `overrides.yaml`,
    the only record of the config its checkpoints were trained with: the refused run's own
    record sits next to it, named by its order in the dir."""
    run_dir = cwd / "run"
    shutil.copytree(world["earlier"] / PREV, run_dir)
    record = {p.name: p.read_text() for p in (run_dir / ".hydra").iterdir()}
    before = _snapshot(cwd / PREV)
    proc = python_train(cwd, *SMALL, "trainer.max_steps=9", "model=cnn", f"hydra.run.dir={run_dir}")
    line = _one_error_line(proc)
    assert "checkpoint of a different model" in line and ".hydra/config.yaml" in line, line
    assert "trainer.resume=never" in line
    assert {p.name: p.read_text() for p in (run_dir / ".hydra").iterdir()} == record
    assert "model=cnn" in (run_dir / ".hydra.2" / "overrides.yaml").read_text()
    assert _snapshot(cwd / PREV) == before, "the earlier run's outputs were touched"
    assert not world["marker"].exists()


@pytest.mark.slow
def test_cli_self_launch_preflight_error_is_one_line_before_any_worker(cwd: Path) -> None:
    """dist.nproc_per_node=2 with an unknown trainer.monitor: the launching process refuses the
    job once (not once per worker), exit 2, and nothing is trained or written."""
    before = _snapshot(cwd / PREV)
    proc = python_train(
        cwd,
        "dist.nproc_per_node=2",
        "trainer.monitor=val/nope",
        *SMALL,
        "hydra.run.dir=new",
        timeout=120,
    )
    line = _one_error_line(proc)
    assert "trainer.monitor=val/nope" in line and "val/loss, val/acc" in line, line
    assert "starting 2 workers" not in proc.stdout + proc.stderr
    written = [p.name for p in (cwd / "new").rglob("*") if p.is_file()]
    assert not [n for n in written if n == "summary.json" or n.endswith((".pt", ".jsonl"))]
    assert _snapshot(cwd / PREV) == before


@pytest.mark.slow
def test_torchrun_worker_error_is_ours_in_one_line(tmp_path: Path) -> None:
    """Under torchrun each failing rank prints our one-line error; torchrun then adds its own
    ChildFailedError report, which we cannot suppress: none of its frames may be ours."""
    env = user_env(tmp_path, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(TESTS)]))
    proc = torchrun(
        tmp_path,
        *SMALL,
        "model._target_=helpers.unused_model.MLPWithUnusedHead",
        env=env,
        timeout=150,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "error: some model parameters got no gradient" in out and "ddp=unused_params" in out
    assert out.count("Traceback") <= 1, out[-5000:]
    if "Traceback" in out:
        tb = out[out.index("Traceback") :]
        assert "ChildFailedError" in tb and "hydra_ddp" not in tb.split("ChildFailedError")[0]
