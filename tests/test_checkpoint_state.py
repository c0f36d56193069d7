"""What a checkpoint holds is what resume can read: a callback's numpy values are made plain at
save (resume and `python -m hydra_ddp.eval` load the file with weights_only=True), and state no
plain type can hold is refused at the first save, in one line naming the callback and key."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FAST
from helpers import state_callbacks
from helpers.inproc import compose, isolated, train_here, train_ranks
from omegaconf import OmegaConf

from hydra_ddp.checkpoint import checkpointer
from hydra_ddp.errors import UserError
from hydra_ddp.eval import main as evaluate_main

JOB = [
    *FAST,
    "trainer.ckpt_interval=2",
    "+callbacks.stats._target_=helpers.state_callbacks.NumpyState",
]


def test_numpy_state_is_saved_plain_and_resumed(tmp_path: Path) -> None:
    train_here(tmp_path, *JOB, "trainer.max_steps=2")
    path = tmp_path / "checkpoints" / "step_00000002.pt"
    state = torch.load(path, weights_only=True)["rng"][0]["callbacks"]["stats"]  # no numpy
    assert type(state["mean"]) is float and type(state["count"]) is int and state["count"] == 2
    assert isinstance(state["history"], torch.Tensor) and state["history"].tolist() == [2, 1, 0]
    assert state["nested"]["pair"] == (1, 0.5) and type(state["nested"]["pair"][0]) is int
    state_callbacks.NumpyState.loaded = None
    train_here(tmp_path, *JOB, "trainer.max_steps=4")  # resumes from step 2
    loaded = state_callbacks.NumpyState.loaded
    assert loaded is not None and loaded["count"] == 2 and loaded["mean"] == state["mean"]
    assert (tmp_path / "checkpoints" / "step_00000004.pt").is_file()
    # `python -m hydra_ddp.eval run=...` (its main, in process) loads the same kind of file;
    # on an error it would exit (SystemExit fails the test).
    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(compose(*JOB, "trainer.max_steps=4"), tmp_path / ".hydra" / "config.yaml")
    with isolated():
        evaluate_main([f"run={tmp_path}"])
    assert json.loads((tmp_path / "eval_test.json").read_text())["step"] == 4


def test_state_no_plain_type_can_hold_is_refused_at_the_first_save(tmp_path: Path) -> None:
    job = [*FAST, "trainer.max_steps=4", "trainer.ckpt_interval=2",
           "+callbacks.odd._target_=helpers.state_callbacks.OpaqueState"]  # fmt: skip
    with pytest.raises(UserError) as caught:
        train_here(tmp_path, *job)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        "callbacks.odd: state_dict()['thing'] holds a helpers.state_callbacks.Opaque, which "
        "torch.load(weights_only=True) cannot read back"
    ), message
    assert not list((tmp_path / "checkpoints").glob("*.pt")), "no unloadable file written"


def test_conversions_keep_what_is_already_plain() -> None:
    Point = collections.namedtuple("Point", "x y")
    model_state = torch.nn.Linear(2, 2).state_dict()
    value = {
        "model": model_state,
        "np": [np.bool_(True), np.str_("a"), np.array(["a", "b"]), np.arange(3, dtype=np.int32)],
        "other": (Point(1, 2), frozenset({3}), collections.defaultdict(int, a=1), Path("/x")),
        np.int64(7): 1,
    }
    out = checkpointer.loadable(value)
    assert out["model"] is model_state  # unchanged containers are the same objects (_metadata)
    assert out["np"][:3] == [True, "a", ["a", "b"]] and type(out["np"][1]) is str
    assert out["np"][3].dtype == torch.int32 and out["np"][3].tolist() == [0, 1, 2]
    assert out["other"] == ((1, 2), {3}, {"a": 1}, "/x") and type(out["other"][0]) is tuple
    assert list(out)[-1] == 7 and type(list(out)[-1]) is int
    with pytest.raises(checkpointer.Unloadable) as caught:
        checkpointer.loadable({"a": [1, {"b": object()}]})
    assert caught.value.where == "['a'][1]['b']" and caught.value.kind == "builtins.object"


def test_the_refusal_stops_every_rank_at_the_same_save(tmp_path: Path) -> None:
    """Rank 0 alone holds the state it saves; the refusal reaches every rank through the
    gather of the save, so none waits for a rank that has left."""
    job = [*FAST, "trainer.max_steps=4", "trainer.ckpt_interval=2",
           "+callbacks.odd._target_=helpers.state_callbacks.OpaqueState"]  # fmt: skip
    errors = train_ranks(tmp_path, *job, return_exceptions=True, timeout=120)
    assert [type(e) for e in errors] == [UserError, UserError], errors
    assert str(errors[0]) == str(errors[1])
    assert str(errors[1]).startswith("callbacks.odd: state_dict()['thing'] holds")
    assert not list((tmp_path / "checkpoints").glob("*.pt"))
