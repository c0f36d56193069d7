"""Data sources, and the per-rank view of them that a sampler policy asks for (the contracts:
`DataSource`, `SamplerPolicy` and `EpochSampler` of `hydra_ddp.protocols`).

What you edit or copy: sources.py (the sources; `data._target_` names one, the rest of `data.*`
are its arguments) and policies.py (the sampler policies; sampling.py holds the samplers they
return). datasets.py is what a source's `load` returns and its check before training; view.py
is a rank's view (`TrainData`, `EvalData`); epoch_rows.py and split_record.py say what a resume
that changes the sampler or the split reads twice, skips or mixes.
"""

from hydra_ddp.data.datasets import SPLITS, Origin, Rows, TokenWindows, check_loaded
from hydra_ddp.data.policies import SamplerPolicy, Sharded, Strided
from hydra_ddp.data.sources import (
    CharText,
    DataSource,
    Diabetes,
    Digits,
    InMemoryArrays,
    SyntheticArrays,
    TorchDatasets,
    check_source,
    split_digits,
)
from hydra_ddp.data.view import EvalData, TrainData, check_sampling, loader
from hydra_ddp.protocols import Ranges

__all__ = [
    "SPLITS", "CharText", "DataSource", "Diabetes", "Digits", "EvalData", "InMemoryArrays",
    "Origin", "Ranges", "Rows", "SamplerPolicy", "Sharded", "Strided", "SyntheticArrays",
    "TokenWindows", "TorchDatasets", "TrainData", "check_loaded",
    "check_sampling", "check_source", "loader", "split_digits",
]  # fmt: skip
