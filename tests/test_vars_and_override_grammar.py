"""The command line's smaller doors: user variables under `vars` (added with or without `+`,
and the error for an unknown top-level key says so), what the command refuses in one line
before Hydra composes (launch/command.py), `hydra_ddp.eval` takes the training command line's
override grammar, the "not an argument" error says how to start clean when a replaced model's
arguments were merged in, and the unused-parameter error names the parameters."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FAST
from helpers.inproc import compose, train_here, train_ranks, typed
from omegaconf import OmegaConf

from hydra_ddp.components import build
from hydra_ddp.errors import UserError
from hydra_ddp.eval import job_config
from hydra_ddp.launch import command as overrides
from hydra_ddp.launch.command import config_dir


def test_user_variables_go_under_vars() -> None:
    cfg = typed("vars.reads_dir=/data", "+vars.n=3", "vars.nested={a:1}")
    assert cfg.vars == {"reads_dir": "/data", "n": 3, "nested": {"a": 1}}
    assert typed().vars == {}
    # Read through an interpolation, as a YAML of the user's would.
    dict_cfg = compose("vars.reads_dir=/data", "+data.note=${vars.reads_dir}/x")
    assert dict_cfg.data.note == "/data/x"
    # Other mappings stay closed: a typo'd key still fails at composition.
    with pytest.raises(Exception, match="Could not override 'trainer.batchsize'"):
        compose("trainer.batchsize=3")


def test_an_unknown_top_level_key_says_where_variables_go(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "hydra_ddp.train", "reads_dir=/data"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: reads_dir is not a key"), lines
    assert "vars.reads_dir=..." in lines[0] and "+reads_dir=..." in lines[0]
    assert not list(tmp_path.iterdir()), "nothing written"


# What the command line asks for, refused in one line before Hydra composes it (a choice no
# YAML file provides, a key a typed group lacks, a value its type refuses, in a sweep too),
# and what it must let through to Hydra (open mappings, additions, plugin groups, variables).
REFUSED = {
    "sampler=nope": "sampler=nope: conf/sampler/ has no nope.yaml; the choices are sharded",
    "model=mlp,nope": "model=nope: conf/model/ has no nope.yaml",
    "trainer.max_steps=abc": "trainer.max_steps='abc' is not allowed: Value 'abc' of type 'str'",
    "trainer.batch_size=8,abc": "trainer.batch_size='abc' is not allowed",
    "ddp.param_dtype=bf17": "ddp.param_dtype='bf17' is not allowed",
    "trainer.batchsize=3": "trainer.batchsize is not a key of trainer",
    "trainer.password=S3CRET": "trainer.password is not a key of trainer",
    "model.hidden=choice()": "model.hidden=choice(): Hydra cannot read this override (ValueError",
    "vars.password=S3CRET(": "vars.password=<redacted>: Hydra cannot read this override: see",
}
ACCEPTED = [
    "model=cnn", "trainer.max_steps=3", "ddp=fsdp2", "ddp.param_dtype=bf16", "hydra/launcher=ray",
    "+trainer.extra=1", "vars.reads_dir=/data", "experiment=text_gpt", "logger.sink.project=p",
    "trainer.grad_clip.generator=1", "optim.lr=tag(log,interval(1e-4,1e-2))", "~callbacks",
]  # fmt: skip


@pytest.mark.parametrize("override", sorted(REFUSED))
def test_the_command_line_is_checked_before_hydra(override: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        overrides.check_command_line(["-m", override], [Path(config_dir())])
    assert info.value.code == 2
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and line.startswith(f"error: {REFUSED[override]}"), line
    assert "S3CRET" not in line  # a mistyped key's value may be a secret: never echoed
    overrides.check_command_line(ACCEPTED, [Path(config_dir())])


def test_a_mistyped_secret_key_is_one_line_without_its_value(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "hydra_ddp.train", "trainer.password=S3CRET"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "S3CRET" not in proc.stdout + proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "trainer.password is not a key of trainer" in lines[0], lines
    assert not list(tmp_path.iterdir()), "nothing written"


def test_eval_takes_the_training_override_grammar(tmp_path: Path) -> None:
    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(compose(*FAST), tmp_path / ".hydra" / "config.yaml")
    cfg = job_config(tmp_path, ["+data.extra=1", "trainer.batch_size=8", "~metrics.acc",
                                "vars.x=2", "++optim.foreach=false"])  # fmt: skip
    assert cfg.data["extra"] == 1 and cfg.trainer.batch_size == 8 and cfg.metrics == {}
    assert cfg.vars == {"x": 2} and cfg.optim["foreach"] is False
    for bad, said in [
        (["data.extra=1"], r"has no data\.extra; to add it use \+data\.extra=1"),
        (["+trainer.batch_size=8"], r"already in the run's config; drop the \+"),
        (["~trainer.nope"], r"no trainer\.nope to delete"),
        (["trainer.seed=1,2"], "not a sweep"),
        (["model=cnn"], r"the config group model is already chosen; set its keys"),
        (["+trainer.nope=1"], r"\+trainer\.nope=1: Key 'nope' not in 'TrainerConfig'"),
    ]:
        with pytest.raises(UserError, match=said):
            job_config(tmp_path, bad)


def test_merged_arguments_of_a_replaced_model_say_how_to_start_clean() -> None:
    cfg = typed("model._target_=torch.nn.Linear", "+model.in_features=3", "+model.out_features=2")
    with pytest.raises(UserError, match=r"model\.depth is not an argument of torch\.nn\.Linear.*"
                       r"override /model: null.*~model\.depth"):  # fmt: skip
        build(cfg.model, "model")
    with pytest.raises(UserError) as typo:  # a misspelling gets no such advice
        build(typed("+model.hiddenn=3").model, "model", in_features=1, out_features=2)
    assert "override /model" not in str(typo.value)


def test_the_unused_parameter_error_names_the_parameters(tmp_path: Path) -> None:
    results = train_ranks(tmp_path, *FAST, "model._target_=helpers.unused_model.MLPWithUnusedHead",
                          "trainer.max_steps=3", return_exceptions=True)  # fmt: skip
    for r in results:
        assert isinstance(r, UserError), r
        assert "got no gradient in a step (spare.weight, spare.bias)" in str(r)
        assert "ddp=unused_params" in str(r)
    # One rank (no DDP wrapper): nothing to refuse, it trains.
    unused = "model._target_=helpers.unused_model.MLPWithUnusedHead"
    assert train_here(tmp_path / "one", *FAST, unused, "trainer.max_steps=2")["steps"] == 2


def test_eval_reads_a_run_saved_when_the_sink_was_logger_backend(tmp_path: Path) -> None:
    # Runs of earlier versions saved `logger.backend: wandb` (no `logger.sink`).
    saved = OmegaConf.to_container(compose(*FAST))
    saved["logger"].pop("sink")
    saved["logger"]["backend"] = "wandb"
    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(OmegaConf.create(saved), tmp_path / ".hydra" / "config.yaml")
    cfg = job_config(tmp_path, ["trainer.batch_size=8"])
    assert cfg.trainer.batch_size == 8 and cfg.logger.sink is None


def test_a_config_dir_given_on_the_command_line_counts_for_the_choices(tmp_path: Path) -> None:
    """`--config-path`/`-cp` and `--config-dir`/`-cd` (the checker starts its runs with them
    for a thin project) add their groups' choices: `model=mine` there is no refusal."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text("_target_: my.Model\n")
    for flags in (["--config-dir", str(tmp_path)], [f"-cp={tmp_path}"]):
        given = [Path(d) for d in overrides.config_dirs_given(flags)]
        assert given == [tmp_path]
        overrides.check_command_line([*flags, "model=mine"], [Path(config_dir()), *given])
    assert overrides.config_dirs_given(["-cd", "pkg://myproj.conf"]) == ["pkg://myproj.conf"]
