"""Composition and components, in process: every group choice composes, every component builds,
each default lives in one place, and bad values fail early with a line that names the key."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import get_object
from omegaconf import OmegaConf

from hydra_ddp import config as C
from hydra_ddp.components import build
from hydra_ddp.errors import UserError
from hydra_ddp.rank_job import build_components
from hydra_ddp.rundir.paths import register_resolvers

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = {
    g.name: sorted(p.stem for p in g.glob("*.yaml"))
    for g in CONF.iterdir()
    # hparams_search, experiment and debug are command-line-only groups of the whole config
    # (tests/test_sweeps.py, tests/test_presets.py, tests/test_debug_presets.py).
    if g.is_dir() and g.name not in ("hydra", "hparams_search", "experiment", "debug")
}
TYPED = {"ddp": C.DDPConfig, "logger": C.LoggerConfig}
COMPONENTS = ("data", "model", "optim", "scheduler", "loss", "sampler")

C.register_configs()
register_resolvers()


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def typed(*overrides: str) -> C.TrainConfig:
    return OmegaConf.to_object(composed(*overrides))


def test_every_group_is_present() -> None:
    assert set(GROUPS) == {
        "ddp",
        "sampler",
        "data",
        "model",
        "optim",
        "scheduler",
        "loss",
        "metrics",
        "logger",
    }
    assert {
        "default",
        "unused_params",
        "static_graph",
        "fp16_compress",
        "bf16_compress",
        "powersgd",
        "none",
    } <= set(GROUPS["ddp"])
    assert set(GROUPS["sampler"]) == {"strided", "sharded"}
    # The example data sets and models are exercised by JOBS below (synthetic needs files on
    # disk: test_train.py). A project made with scripts/new_project.py may strip some.


@pytest.mark.parametrize("group,choice", [(g, c) for g, cs in GROUPS.items() for c in cs])
def test_every_choice_composes(group: str, choice: str) -> None:
    cfg = typed(f"{group}={choice}")
    node = getattr(cfg, group)
    if group in TYPED:
        assert isinstance(node, TYPED[group]), f"{group}={choice} is untyped: {node!r}"
    elif group == "metrics":  # a dict of components; metrics=none: the loss alone
        assert all("_target_" in m for m in node.values()) and (node or choice == "none")
    elif group == "optim" and "_target_" not in node:  # several named optimizers
        assert node and all("_target_" in o and "params" in o for o in node.values()), node
    else:
        assert "_target_" in node, f"{group}={choice} names no _target_"
    assert isinstance(cfg.trainer, C.TrainerConfig) and isinstance(cfg.dist, C.DistConfig)


# Each data set with a model that fits it: every component of the composed job builds.
JOBS = [
    ["data=digits", "model=mlp"],
    ["data=digits", "model=cnn", "optim=sgd"],
    ["data=text", "model=gpt", "model.n_layer=1", "scheduler=constant"],
    ["data=diabetes", "model=mlp", "loss=huber"],
]


@pytest.mark.parametrize("overrides", JOBS, ids=lambda o: ",".join(o))
def test_every_component_builds_and_runs_a_step(overrides: list[str]) -> None:
    cfg = typed(*overrides)
    source = build(cfg.data, "data")
    parts = build_components(cfg, source, torch.device("cpu"), total_steps=10)
    x, y = source.load("train", [(0, 4)])[torch.arange(4).numpy()]
    out = parts.model(x)
    loss, _ = parts.loss(out, (x, y), parts.model)
    loss.backward()
    for optimizer in parts.optimizers.optimizers.values():
        optimizer.step()
    parts.optimizers.step_schedules()
    assert torch.isfinite(loss)
    for name, metric in parts.metrics.items():
        assert isinstance(metric.compute(metric.sums(out.detach(), y).tolist()), float), name


def test_data_picks_the_loss_and_metrics_of_its_task_and_the_command_line_wins() -> None:
    assert composed().loss._target_ == "hydra_ddp.losses.CrossEntropy"
    assert set(composed().metrics) == {"acc"}
    assert set(composed("data=text", "model=gpt").metrics) == {"ppl", "bpc"}
    reg = composed("data=diabetes")
    assert reg.loss._target_ == "torch.nn.MSELoss" and set(reg.metrics) == {"mse", "r2"}
    assert composed("data=diabetes", "loss=huber").loss._target_ == "torch.nn.HuberLoss"
    assert composed("loss.label_smoothing=0.1").loss.label_smoothing == 0.1


def test_defaults() -> None:
    cfg = typed()
    assert cfg.data["_target_"] == "hydra_ddp.data.Digits"
    assert cfg.model["_target_"] == "hydra_ddp.models.MLP"
    assert cfg.optim["_target_"] == "torch.optim.AdamW"
    assert cfg.sampler["_target_"] == "hydra_ddp.data.policies.Strided"
    assert cfg.ddp.enabled and cfg.ddp.comm_hook == "none"
    assert cfg.logger.sink == {"_target_": "hydra_ddp.tracking.wandb_sink.WandbSink"}
    assert cfg.logger.layout == C.Layout.gather
    assert cfg.trainer.resume == "auto" and cfg.trainer.epochs == 40


def test_presets_set_what_they_say() -> None:
    assert typed("ddp=unused_params").ddp.find_unused_parameters
    assert typed("ddp=static_graph").ddp.static_graph
    assert typed("ddp=none").ddp.enabled is False
    bf16 = typed("ddp=bf16_compress").ddp.comm_hook
    assert bf16["_target_"] == "hydra_ddp.distributed.comm_hooks.BF16Compress"
    powersgd = typed("ddp=powersgd", "ddp.powersgd_rank=3").ddp.comm_hook
    assert powersgd == {
        "_target_": "hydra_ddp.distributed.comm_hooks.PowerSGD",
        "rank": 3,
        "start_iter": 10,
    }
    assert typed("sampler=sharded").sampler["_target_"] == "hydra_ddp.data.policies.Sharded"
    assert typed("optim=sgd").optim["_target_"] == "torch.optim.SGD"
    assert typed("model=gpt", "data=text").model["n_layer"] == 4


def test_command_line_overrides_are_typed() -> None:
    cfg = typed(
        "trainer.batch_size=128",
        "trainer.precision=bf16",
        "dist.backend=gloo",
        "sampler=sharded",
        "sampler.shard_by=files",
        "ddp.bucket_cap_mb=50.5",
    )
    assert cfg.trainer.batch_size == 128 and cfg.trainer.precision == C.Precision.bf16
    assert cfg.dist.backend == C.Backend.gloo and cfg.sampler["shard_by"] == "files"
    assert cfg.ddp.bucket_cap_mb == 50.5


# ------------------------------------------------------------------------------------------
# One source of truth for every default
# ------------------------------------------------------------------------------------------


def _yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


def _dataclass_defaults(cls: type) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default.value if hasattr(f.default, "value") else f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _twice() -> list[str]:
    """Every value written both in a YAML and in the schema or the target's signature."""
    found = []
    # The template's own groups: a choice's YAML holds only what it changes.
    for group, cls in TYPED.items():
        defaults = _dataclass_defaults(cls)
        for path in (CONF / group).glob("*.yaml"):
            for key, value in _yaml(path).items():
                if key in defaults and defaults[key] == value:
                    found.append(f"{path.name}: {group}.{key}={value!r} repeats {cls.__name__}")
    top = _yaml(CONF / "train.yaml")
    for section, cls in [("trainer", C.TrainerConfig), ("dist", C.DistConfig), *TYPED.items()]:
        defaults = _dataclass_defaults(cls)
        for key, value in (top.get(section) or {}).items():
            found.append(
                f"train.yaml: {section}.{key}={value!r} (default {defaults.get(key)!r} "
                f"is in {cls.__name__})"
            )
    # Components of the template: the YAML holds the value, the signature has no default.
    for group in (*COMPONENTS, "metrics"):
        for path in (CONF / group).glob("*.yaml"):
            doc = _yaml(path)
            nodes = (
                [doc.get(group, {})]
                if group == "data"
                else (list(doc.values()) if group == "metrics" else [doc])
            )
            if group == "optim" and "_target_" not in doc:  # named optimizers
                nodes = list(doc.values())
            for node in nodes:
                target = node.get("_target_", "")
                if not target:
                    continue
                params = inspect.signature(get_object(target)).parameters
                for key, value in node.items():
                    p = params.get(key)
                    if p is None or p.default is inspect.Parameter.empty:
                        continue
                    if target.startswith("hydra_ddp.") or p.default != value:
                        if target.startswith("hydra_ddp."):
                            found.append(
                                f"{group}/{path.name}: {key} also defaults to "
                                f"{p.default!r} in {target}"
                            )
    return found


def test_no_default_is_defined_twice() -> None:
    assert _twice() == []


def test_the_twice_check_catches_a_repeated_value(tmp_path: Path, monkeypatch) -> None:
    """The check above is only worth something if it fails on a drifted copy."""
    global CONF
    copy = tmp_path / "conf"
    import shutil

    shutil.copytree(CONF, copy)
    (copy / "ddp" / "default.yaml").write_text("bucket_cap_mb: 25.0\n")
    (copy / "train.yaml").write_text(
        (copy / "train.yaml").read_text() + "\ntrainer:\n  epochs: 10\n"
    )
    monkeypatch.setattr(__import__(__name__), "CONF", copy)
    found = _twice()
    assert any("ddp.bucket_cap_mb" in f for f in found), found
    assert any("trainer.epochs" in f for f in found), found


# ------------------------------------------------------------------------------------------
# Bad values
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override",
    [
        "trainer.batchsize=3",  # typo'd key
        "trainer.batch_size=abc",  # wrong type
        "trainer.precision=fp8",  # not an Enum member
        "model=transformer",  # unknown group choice
        "ddp.bucket_cap=3",  # typo inside a typed group
    ],
)
def test_compose_time_errors(override: str) -> None:
    with pytest.raises(ConfigCompositionException):
        typed(override)


@pytest.mark.parametrize(
    "override,key",
    [
        ("trainer.batch_size=0", "trainer.batch_size"),
        ("trainer.batch_size=-4", "trainer.batch_size"),
        ("trainer.epochs=0", "trainer.epochs"),
        ("trainer.max_steps=0", "trainer.max_steps"),
        ("trainer.grad_accum=0", "trainer.grad_accum"),
        ("trainer.seed=-1", "trainer.seed"),
        ("trainer.seed=99999999999999999999999", "trainer.seed"),  # torch's seed overflows
        ("trainer.log_interval=0", "trainer.log_interval"),
        ("ddp.bucket_cap_mb=0", "ddp.bucket_cap_mb"),
        ("ddp.bucket_cap_mb=-1", "ddp.bucket_cap_mb"),
        ("dist.timeout_s=0", "dist.timeout_s"),
        ("dist.nproc_per_node=0", "dist.nproc_per_node"),
    ],
)
def test_typed_checks_name_the_key(override: str, key: str) -> None:
    with pytest.raises(UserError) as info:
        typed(override)
    message = str(info.value)
    assert key in message and "\n" not in message


def _build_job(*overrides: str) -> None:
    cfg = typed(*overrides)
    build_components(cfg, build(cfg.data, "data"), torch.device("cpu"), total_steps=10)


@pytest.mark.parametrize(
    "overrides,expect",
    [
        (["model.hidden=0"], ["model.hidden=0 is not allowed", "> 0"]),
        (["model.dropout=1.0"], ["model.dropout=1.0", "[0, 1)"]),
        (["data.val_fraction=1.5"], ["data.val_fraction=1.5"]),
        (
            ["data.val_fraction=0.6", "data.test_fraction=0.5"],
            ["data.val_fraction + data.test_fraction"],
        ),
        (["model=gpt", "data=text", "model.n_head=3"], ["model.n_embd=128", "n_head=3"]),
        (["loss.label_smoothing=1.5"], ["loss.label_smoothing=1.5"]),
        (["scheduler.warmup_steps=-1"], ["scheduler.warmup_steps=-1"]),
        (["optim.lr=-1"], ["optim (torch.optim.AdamW)", "learning rate"]),
        # A typo'd or unknown argument: the key, and what the target accepts.
        (
            ["+model.hiddden=3"],
            [
                "model.hiddden is not an argument of hydra_ddp.models.MLP",
                "in_features, out_features, hidden, depth, dropout",
            ],
        ),
        (["+optim.momentum=0.9"], ["optim.momentum is not an argument of torch.optim.AdamW"]),
        # Another kind than the annotation says: the key and the type, not torch's words.
        (["model.hidden=abc"], ["model.hidden='abc' is not allowed", "takes hidden: int"]),
        (["model.dropout=true"], ["model.dropout=True is not allowed", "dropout: float"]),
        # A model that does not fit the data: what it needs, and what the data provides.
        (
            ["model=gpt"],
            ["model (hydra_ddp.models.GPT) needs vocab_size, block_size", "in_features"],
        ),
        (["model._target_=nowhere.Model"], ["model._target_='nowhere.Model' cannot be imported"]),
    ],
)
def test_component_errors_name_the_key(overrides: list[str], expect: list[str]) -> None:
    with pytest.raises(UserError) as info:
        _build_job(*overrides)
    message = str(info.value)
    assert "\n" not in message
    for want in expect:
        assert want in message, message


@pytest.mark.parametrize(
    "override", ["+trainer.fast_dev_run=true", "+ddp.bucket_size=1", "+logger.projcet=x"]
)
def test_plus_key_under_a_typed_group_is_refused(override: str) -> None:
    """`+key=value` adds a key even to a typed group, where it used to be silently ignored."""
    from hydra_ddp.launch.runner import to_typed

    key = override[1:].split("=")[0]
    with pytest.raises(UserError, match=rf"^{key} is not a key of {key.split('.')[0]} "):
        to_typed(composed(override))


def test_a_dollar_brace_value_on_the_command_line_is_one_line_saying_how_to_escape() -> None:
    """`logger.name='a${IFS}b'` (a shell variable, a template string) is read by OmegaConf as
    an interpolation: the entry turns the raw InterpolationKeyError into one line."""
    from omegaconf import OmegaConf

    from hydra_ddp.errors import UserError, config_error

    with pytest.raises(Exception) as raised:  # what hydra_entry catches
        OmegaConf.to_container(composed("logger.name=a${IFS}b"), resolve=True)
    error = config_error(raised.value)
    assert isinstance(error, UserError)
    line = str(error)
    assert line.startswith("logger.name: Interpolation key 'IFS' not found") and "\n" not in line
    assert "escape it on the command line as \\${...}" in line
    # Escaped, it is kept as written.
    escaped = OmegaConf.to_container(composed("logger.name=a\\${IFS}b"), resolve=True)
    assert escaped["logger"]["name"] == "a${IFS}b"
