"""A user's contrastive loss that gathers in evaluation too (tests/ on PYTHONPATH): what the
template's example avoids by checking `model.training`."""

from __future__ import annotations

import types

from hydra_ddp.examples.contrastive import nt_xent


def gathers_always(output, model, temperature: float = 0.5):
    return nt_xent(output, types.SimpleNamespace(training=True), temperature)
