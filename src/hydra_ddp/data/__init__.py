"""Data sources, and the per-rank view of them that a sampler policy asks for.

A source is a component: `data._target_` names its class, the rest of `data.*` are its
constructor's arguments (contracts: `DataSource`, `SamplerPolicy` and `EpochSampler` of
`hydra_ddp.protocols`). They are small so that `sampler=sharded` can make each rank read only
its own rows (`load(split, ranges)`), and a batch is one vectorised gather (`ds[idx]` with an
int64 index array). Checks that need no rows (shapes, dtypes) belong in a source's
constructor, which runs in the launching process before any process group starts; what is
loaded is checked by `check_loaded` (datasets.py) before training, on every source.

The sources here need no download: scikit-learn's digits and diabetes ship inside its package,
the text is CPython's own pydoc_data.topics, and synthetic shards are written by
scripts/make_synthetic.py. What you edit or copy: sources.py (the sources),
policies.py (the sampler policies; sampling.py holds the samplers they return). view.py is a
rank's view (`TrainData`, `EvalData`); epoch_rows.py and split_record.py say what a resume
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
