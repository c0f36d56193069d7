"""`python -m hydra_ddp.check`: short real runs of the user's training, checked.

In process: the rows check against the sampler policies (the built-in ones pass, a policy that
hands every rank the same rows fails, naming it), the command line's refusals, and the table of
a failed check from `main`. Slow (each a real command of several launches): the default
digits config passes every check (its runs in a temporary dir that is cleared but for
check.json); each planted mistake (tests/helpers/) fails the check made for it with a line
naming it, another rank count under sampler=sharded is not checked and says why with the rows
counted, a thin project's configs (scripts/thin_template) are checked through --config-path, and
ddp=fsdp2 passes rank agreement (the drifting model too: its change does not reach the shards),
resume and the checkpoint round trip.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from conftest import REPO, TESTS, run, user_env
from helpers.inproc import typed

from hydra_ddp.check import checks, main
from hydra_ddp.check.runs import CheckPlan

DEFAULT_TITLES = (
    "rank agreement", "resume equivalence", "rows", "determinism", "gradient sync",
    "checkpoint round trip",
)  # fmt: skip


def plan(*overrides: str, world: int = 2) -> CheckPlan:
    return CheckPlan(typed(*overrides), list(overrides), [], world, 8, Path("/nonexistent"))


def test_rows_pass_for_the_built_in_policies_and_fail_for_one_that_repeats_rows() -> None:
    for overrides in ([], ["sampler.drop_last=true"], ["sampler=sharded"]):
        result = checks.row_coverage(plan(*overrides), None)
        assert result.status == "PASS", (overrides, result)
        assert "1257 rows, each once per epoch" in result.measured
        assert "0 val/test rows trained on (by origin(split))" in result.measured
    padding = checks.row_coverage(plan(), None).measured
    assert "(1 padding, 0 dropped)" in padding  # 1257 rows on 2 ranks: one row read twice
    same_rows = "sampler._target_=helpers.repeating_policy.SameRowsEverywhere"
    repeating = checks.row_coverage(plan(same_rows), None)
    assert repeating.status == "FAIL"
    assert "629 rows read again, 628 of 1257 never" in repeating.measured
    assert "SameRowsEverywhere (sampler._target_) does not split the rows" in repeating.why
    one_rank = checks.row_coverage(plan(same_rows, world=1), None)
    assert one_rank.status == "PASS"  # on one rank, rank 0's rows are all the rows


def _main(monkeypatch: pytest.MonkeyPatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "argv", ["hydra_ddp.check", *argv])
    with pytest.raises(SystemExit) as done:
        main()
    return done.value.code


def test_refusals_and_a_failed_check_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv, said in (
        (["--only", "rows,speed"], "error: --only speed: no such check; the checks: "),
        (["--steps", "1"], "error: --steps 1: at least 2"),
        (["--only", "resume", "--skip", "resume"], "error: --only resume --skip resume leaves no"),
        (["trainer.batch_sise=3"], "error: "),
    ):
        assert _main(monkeypatch, *argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(said) and err.count("\n") == 1, (argv, err)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "summary.json").write_text("{}")  # a run of the user's
    assert _main(monkeypatch, f"hydra.run.dir={taken}") == 2
    assert "is not empty: give a new dir" in capsys.readouterr().err
    assert sorted(p.name for p in taken.iterdir()) == ["summary.json"]

    out = tmp_path / "check"
    policy = "sampler._target_=helpers.repeating_policy.SameRowsEverywhere"
    assert _main(monkeypatch, "--only", "rows", policy, f"hydra.run.dir={out}") == 1
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["check", "result", "measured"]
    assert table[1].startswith("rows") and "FAIL" in table[1]
    assert table[2].strip().startswith("-> the sampler policy SameRowsEverywhere")
    report = json.loads((out / "check.json").read_text())
    assert report["passed"] is False and list(report["checks"]) == ["rows"]
    assert sorted(p.name for p in out.iterdir()) == ["check.json"]  # no run was needed


def _check(tmp_path: Path, *args: str, timeout: float = 900) -> tuple[object, dict, Path]:
    """The command as a user types it, from tmp_path, with tests/helpers importable."""
    env = user_env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env["PYTHONPATH"]])
    proc = run([sys.executable, "-m", "hydra_ddp.check", *args], tmp_path, env=env,
               timeout=timeout)  # fmt: skip
    found = re.search(r": (\S+check\.json)$", proc.stdout.strip())
    report = Path(found[1]) if found else tmp_path / "missing"
    return proc, json.loads(report.read_text()) if report.is_file() else {}, report


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_default_config_passes_every_check(tmp_path: Path) -> None:
    proc, report, path = _check(tmp_path, "--steps", "8")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = proc.stdout.splitlines()[1:7]
    assert [r[:21].strip() for r in rows] == list(DEFAULT_TITLES), proc.stdout
    assert all(" PASS " in r for r in rows) and "->" not in proc.stdout, proc.stdout
    assert report["passed"] is True and report["world_size"] == 2 and report["steps"] == 8
    measured = {name: c["measured"] for name, c in report["checks"].items()}
    assert measured["rank_agreement"].startswith("max |diff| 0 over 6 tensors, 2 ranks")
    assert measured["resume"].startswith("8 steps = 4 + SIGTERM + 4 resumed: bitwise")
    assert "on 1 rank(s) the same rows at every step" in measured["resume"]
    assert "losses bitwise equal" in measured["determinism"]
    assert "tolerance 1e-05" in measured["gradient_sync"]
    assert "270 val rows, max |diff| 0 " in measured["checkpoint"]
    # Its runs went to a temporary dir, cleared but for the report; nothing in the working dir.
    assert path.parent.name.startswith("hydra-ddp-check-"), path
    assert sorted(p.name for p in path.parent.iterdir()) == ["check.json"]
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith(("wandb", "no-netrc"))]
    path.unlink()
    path.parent.rmdir()


MISTAKES = {
    "drifting": (
        ["--only", "rank_agreement", "model._target_=helpers.drifting_model.DriftingMLP"],
        "rank_agreement", "net.0.bias differ between ranks",
    ),
    "unused": (
        ["--only", "gradient_sync", "model._target_=helpers.unused_model.MLPWithUnusedHead"],
        "gradient_sync", "spare.weight, spare.bias never get a gradient",
    ),
    "unsaved": (
        ["--only", "resume,checkpoint", "model._target_=helpers.unsaved_state_model.CountingMLP"],
        "resume", "model.calls is 9 uninterrupted and 1 after resuming at step 8",
    ),
    "forgetful": (
        ["--only", "resume", "+callbacks.seen._target_=helpers.forgetful_callback.SeenRows"],
        "resume", "callbacks.seen is not what it was after the resume",
    ),
    "unseeded": (
        ["--only", "determinism", "--steps=4", "model._target_=helpers.unseeded_model.JitteryMLP"],
        "determinism", "another loss from step 1; torch names no non-deterministic op",
    ),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("mistake", MISTAKES)
def test_each_planted_mistake_fails_its_check_naming_it(tmp_path: Path, mistake: str) -> None:
    args, check, said = MISTAKES[mistake]
    proc, report, _ = _check(tmp_path, *args, f"hydra.run.dir={tmp_path / 'check'}")
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert report["checks"][check]["status"] == "FAIL", report
    assert said in report["checks"][check]["why"], report["checks"][check]
    assert said in proc.stdout  # the table says it too
    if mistake == "unsaved":  # the checkpoint does not hold it either
        assert report["checks"]["checkpoint"]["status"] == "FAIL"
        assert "(model.calls changed in training)" in report["checks"]["checkpoint"]["why"]
    if mistake == "unused":  # the run fails as DDP does, naming them too
        assert (tmp_path / "check" / "straight.log").is_file()
    if mistake == "unseeded":  # asked again under torch.use_deterministic_algorithms
        assert (
            "trainer.deterministic=true" in (tmp_path / "check" / "deterministic.log").read_text()
        )
    assert (tmp_path / "check" / "check.json").is_file()  # kept with the runs, to look at


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_fsdp2_runs_pass_rank_agreement_resume_and_the_round_trip(tmp_path: Path) -> None:
    """ddp=fsdp2: each rank's shards gathered whole agree, the resume from a distributed
    checkpoint is bitwise, and hydra_ddp.eval reads it back to the same outputs."""
    only = "rank_agreement,resume,checkpoint"
    proc, report, _ = _check(tmp_path, "--only", only, "ddp=fsdp2", "--steps=8")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    measured = {name: c["measured"] for name, c in report["checks"].items()}
    assert measured["rank_agreement"].startswith("max |diff| 0 over 6 tensors, 2 ranks")
    assert measured["resume"].startswith("8 steps = 4 + SIGTERM + 4 resumed: bitwise")
    assert "max |diff| 0 (hydra_ddp.eval, new process)" in measured["checkpoint"]
    # A forward's in-place change lands in the gathered copy FSDP2 frees: the shards agree.
    drifting = "model._target_=helpers.drifting_model.DriftingMLP"
    proc, report, _ = _check(tmp_path, "--only", "rank_agreement", "ddp=fsdp2", drifting)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_sharded_resume_on_another_rank_count_is_counted_not_checked(tmp_path: Path) -> None:
    # trainer.resume of the command line, too, is the check's to set: the resumed run still
    # resumes from the stopped one.
    proc, report, _ = _check(
        tmp_path,
        "--only",
        "resume",
        "sampler=sharded",
        "--steps=8",
        "trainer.resume=never",
        f"hydra.run.dir={tmp_path / 'check'}",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    measured = report["checks"]["resume"]["measured"]
    assert measured.startswith("8 steps = 4 + SIGTERM + 4 resumed: bitwise"), measured
    assert re.search(r"not checked, 1 rank\(s\) read another order: \d+ rows twice, \d+ skipped",
                     measured), measured  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_thin_projects_configs_are_checked(tmp_path: Path) -> None:
    template = REPO / "scripts" / "thin_template" / "src"
    env = user_env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(template), env["PYTHONPATH"]])
    conf = template / "myproj" / "conf"
    proc = run([sys.executable, "-m", "hydra_ddp.check", f"--config-path={conf}",
                "--config-name=myproj", "--only", "rank_agreement,rows", "--steps", "4",
                f"hydra.run.dir={tmp_path / 'check'}"], tmp_path, env=env, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads((tmp_path / "check" / "check.json").read_text())
    assert [c["status"] for c in report["checks"].values()] == ["PASS", "PASS"], report
    command = (tmp_path / "check" / "straight.log").read_text().splitlines()[0]
    assert f"--config-path={conf}" in command and "--config-name=myproj" in command
