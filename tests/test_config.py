"""Composition: every group choice composes into the typed schema; bad values fail early."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from hydra_ddp import config as C
from hydra_ddp.dist import register_resolvers
from hydra_ddp.errors import UserError

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = {g.name: sorted(p.stem for p in g.glob("*.yaml"))
          for g in CONF.iterdir() if g.is_dir() and g.name != "hydra"}

C.register_configs()
register_resolvers()


def typed(*overrides: str) -> C.TrainConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=list(overrides))
    return OmegaConf.to_object(cfg)


def test_every_group_is_present() -> None:
    assert set(GROUPS) == {"ddp", "sampler", "data", "model", "optim", "logger"}
    assert {"default", "unused_params", "static_graph", "fp16_compress", "bf16_compress",
            "powersgd", "none"} <= set(GROUPS["ddp"])
    assert set(GROUPS["sampler"]) == {"strided", "sharded"}
    assert {"digits", "text", "synthetic"} <= set(GROUPS["data"])
    assert {"mlp", "cnn", "gpt"} <= set(GROUPS["model"])


@pytest.mark.parametrize("group,choice", [(g, c) for g, cs in GROUPS.items() for c in cs])
def test_every_choice_composes_to_the_schema(group: str, choice: str) -> None:
    cfg = typed(f"{group}={choice}")
    node = getattr(cfg, group)
    assert type(node).__module__ == "hydra_ddp.config", f"{group}={choice} is untyped: {node!r}"
    assert isinstance(cfg.trainer, C.TrainerConfig) and isinstance(cfg.dist, C.DistConfig)


def test_defaults() -> None:
    cfg = typed()
    assert isinstance(cfg.data, C.DigitsConfig) and isinstance(cfg.model, C.MLPConfig)
    assert cfg.sampler.policy == C.SamplerPolicy.strided
    assert cfg.ddp.enabled and cfg.ddp.comm_hook == C.CommHook.none
    assert cfg.logger.backend == C.LoggerBackend.wandb and cfg.logger.layout == C.Layout.gather
    assert cfg.trainer.resume == "auto"


def test_presets_set_what_they_say() -> None:
    assert typed("ddp=unused_params").ddp.find_unused_parameters
    assert typed("ddp=static_graph").ddp.static_graph
    assert typed("ddp=none").ddp.enabled is False
    assert typed("ddp=bf16_compress").ddp.comm_hook == C.CommHook.bf16_compress
    assert typed("ddp=powersgd").ddp.comm_hook == C.CommHook.powersgd
    assert typed("sampler=sharded").sampler.policy == C.SamplerPolicy.sharded
    assert typed("optim=sgd").optim.name == C.OptimizerName.sgd
    assert typed("model=gpt", "data=text").model.n_layer == 4


def test_command_line_overrides_are_typed() -> None:
    cfg = typed("trainer.batch_size=128", "trainer.precision=bf16", "dist.backend=gloo",
                "sampler.shard_by=files", "ddp.bucket_cap_mb=50.5")
    assert cfg.trainer.batch_size == 128 and cfg.trainer.precision == C.Precision.bf16
    assert cfg.dist.backend == C.Backend.gloo and cfg.sampler.shard_by == C.ShardBy.files
    assert cfg.ddp.bucket_cap_mb == 50.5


@pytest.mark.parametrize("override,error", [
    ("trainer.batchsize=3", ConfigCompositionException),  # typo'd key
    ("trainer.batch_size=abc", ConfigCompositionException),  # wrong type
    ("trainer.precision=fp8", ConfigCompositionException),  # not an Enum member
    ("model=transformer", Exception),  # unknown group choice
    ("model.hiddden=3", ConfigCompositionException),  # typo inside a group
])
def test_compose_time_errors(override: str, error: type) -> None:
    with pytest.raises(error):
        typed(override)


@pytest.mark.parametrize("override,key", [
    ("trainer.batch_size=0", "trainer.batch_size"),
    ("trainer.batch_size=-4", "trainer.batch_size"),
    ("trainer.epochs=0", "trainer.epochs"),
    ("trainer.max_steps=0", "trainer.max_steps"),
    ("trainer.grad_accum=0", "trainer.grad_accum"),
    ("trainer.log_interval=0", "trainer.log_interval"),
    ("ddp.bucket_cap_mb=0", "ddp.bucket_cap_mb"),
    ("ddp.bucket_cap_mb=-1", "ddp.bucket_cap_mb"),
    ("dist.timeout_s=0", "dist.timeout_s"),
    ("dist.nproc_per_node=0", "dist.nproc_per_node"),
    ("optim.lr=0", "optim.lr"),
    ("model.hidden=0", "model.hidden"),
    ("data.val_fraction=1.5", "data.val_fraction"),
])
def test_cross_field_checks_name_the_key(override: str, key: str) -> None:
    with pytest.raises(UserError) as info:
        typed(override)
    message = str(info.value)
    assert key in message and "\n" not in message


def test_gpt_heads_must_divide_width() -> None:
    with pytest.raises(UserError, match="model.n_embd"):
        typed("model=gpt", "data=text", "model.n_head=3", "model.n_embd=128")
