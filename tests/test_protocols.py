"""hydra_ddp.protocols against the code: every built-in implementation meets its contract, the
contracts are what the loop calls, and docs/extending.md has a section for each."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import torch
import yaml
from helpers.inproc import typed
from torch.distributed.checkpoint.stateful import Stateful

from hydra_ddp import protocols as P
from hydra_ddp.callbacks import HOOKS, SampleText
from hydra_ddp.checkpoint import state
from hydra_ddp.components import build
from hydra_ddp.data import CharText, Diabetes, Digits, TorchDatasets
from hydra_ddp.data.policies import Sharded, Strided
from hydra_ddp.distributed import DistEnv, comm_hooks
from hydra_ddp.step import default_step
from hydra_ddp.tracking import RunInfo
from hydra_ddp.tracking.files import JsonFiles
from hydra_ddp.tracking.tensorboard_sink import TensorBoardSink
from hydra_ddp.tracking.wandb_sink import WandbSink

REPO = Path(__file__).resolve().parents[1]


def test_every_protocol_has_a_section_in_extending_md() -> None:
    text = (REPO / "docs" / "extending.md").read_text()
    for protocol in P.PROTOCOLS:
        assert f"`hydra_ddp.protocols.{protocol.__name__}`" in text, protocol.__name__
    named = set(re.findall(r"^class (\w+)\(Protocol\)", (REPO / "src/hydra_ddp/protocols.py")
                           .read_text(), flags=re.M))  # fmt: skip
    assert named == {p.__name__ for p in P.PROTOCOLS}  # PROTOCOLS lists every one


def test_the_built_in_sinks_meet_sink(tmp_path: Path) -> None:
    for cls in (JsonFiles, WandbSink, TensorBoardSink):
        assert P.missing_members(cls, P.Sink) == [], cls
    run = RunInfo(output_dir=tmp_path, job_name="train", group="g", config={})
    made = [TensorBoardSink(DistEnv(), run, None), JsonFiles(tmp_path, DistEnv(), None)]
    try:
        assert all(isinstance(sink, P.Sink) for sink in made)
    finally:
        for sink in made:
            sink.close()
    # What each logger choice builds: its class, by _target_ alone.
    for choice, cls in (("wandb", WandbSink), ("tensorboard", TensorBoardSink)):
        sink = typed(f"logger={choice}").logger.sink
        assert sink["_target_"] == f"{cls.__module__}.{cls.__qualname__}"
    assert typed("logger=none").logger.sink is None
    assert not isinstance(object(), P.Sink)
    assert P.missing_members(object, P.Sink) == ["log", "summary", "add_config", "close"]


def test_the_built_in_sampler_policies_and_samplers_meet_theirs() -> None:
    policies = [
        Strided(shuffle=True, seed=1, drop_last=False),
        Sharded(shuffle=True, seed=1, drop_last=False, shard_by="rows", rotate=True),
    ]
    policies += [build(dict(yaml.safe_load(p.read_text())), "sampler")
                 for p in sorted((REPO / "conf/sampler").glob("*.yaml"))]  # fmt: skip
    for policy in policies:
        assert isinstance(policy, P.SamplerPolicy), policy
        parts = policy.rank_ranges(10, [10], 2, 0)
        held = 10 if parts is None else sum(b - a for a, b in parts[0])
        sampler = policy.sampler(held, parts, 0, 2, 3)
        assert isinstance(sampler, P.EpochSampler) and isinstance(sampler, Stateful)
        assert len(list(sampler)) == len(sampler)


def test_the_built_in_metrics_and_data_sources_meet_theirs() -> None:
    for path in sorted((REPO / "conf/metrics").glob("*.yaml")):
        for name, node in (yaml.safe_load(path.read_text()) or {}).items():
            metric = build(node, f"metrics.{name}")
            assert isinstance(metric, P.Metric), (path.name, name)
            assert isinstance(metric.compute([1.0, 2.0, 3.0, 4.0]), float)
    sources = [
        Digits(0.1, 0.1, 0),
        Diabetes(0.1, 0.1, 0),
        CharText(16, 0.05, 0.05),
        TorchDatasets([1, 2], [3], [4]),
    ]
    for source in sources:
        assert isinstance(source, P.DataSource), source
        assert source.num_rows("val") >= 1 and len(source.load("val", [(0, 1)])) == 1


def test_the_built_in_comm_hooks_meet_comm_hook() -> None:
    for name in ("fp16_compress", "bf16_compress", "powersgd"):
        hook = comm_hooks.build_comm_hook(name, 1, 2, "cpu")
        assert isinstance(hook, P.CommHook), name
    powersgd = comm_hooks.build_comm_hook("powersgd", 1, 2, "cpu")
    assert isinstance(powersgd, Stateful)
    assert comm_hooks.build_comm_hook("none", 1, 2, "cpu") is None
    # A user's, which subclasses nothing (tests/helpers).
    from helpers.user_comm_hooks import CountingMean
    from helpers.user_sinks import Collect, NotASink

    assert isinstance(CountingMean("x"), P.CommHook) and isinstance(CountingMean("x"), Stateful)
    assert P.missing_members(Collect, P.Sink) == [] and P.missing_members(NotASink, P.Sink)


def test_the_callback_step_and_member_contracts_are_what_the_loop_calls() -> None:
    hooks = [n for n in vars(P.Callback) if n.startswith("on_")]
    assert hooks == list(HOOKS)  # the same hooks, in the same order
    assert any(callable(getattr(SampleText, h, None)) for h in HOOKS)
    assert P.missing_members(SampleText, P.Callback) == []  # every hook is optional
    # The step: default_step takes what Step.__call__ declares, by the same names.
    wanted = list(inspect.signature(P.Step.__call__).parameters)[1:]
    assert list(inspect.signature(default_step).parameters) == wanted
    assert isinstance(default_step, P.Step)
    # A checkpoint entry, as checkpoint/state.py declares one: what it holds is torch's Stateful.
    member = state.Member("model", lambda objects: state.ModelState(objects.model, False))
    held = member.get(state.CheckpointedObjects(model=torch.nn.Linear(2, 2)))
    assert isinstance(held, Stateful)
    assert not isinstance(object(), Stateful)
