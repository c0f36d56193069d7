"""Data sources, and the per-rank view of them that a sampling policy asks for.

The contracts a data set, a sampler policy and its samplers meet are `DataSource`,
`SamplerPolicy` and `EpochSampler` of `hydra_ddp.protocols`: small, so that `sampler=sharded`
can make each rank read only its own rows (`load(split, ranges)`), and a batch is one vectorised
gather (`ds[idx]` with an int64 index array), not batch_size calls.

What is loaded is checked before training starts (`check_loaded`, run on every `load` result
by `TrainData` and `EvalData`, so a source of yours gets it too): float features and targets
must be finite, integer labels in [0, spec["out_features"]) and tokens in
[0, spec["vocab_size"]). A `Rows` told where its segments came from (`origins`) names the file
and row at fault. Checks that need no rows (shapes, dtypes) belong in the source's
constructor, which runs in the launching process before any worker or process group starts.

A source is a component: `data._target_` names its class and the rest of `data.*` are its
constructor's arguments. `Rows` and `TokenWindows` are ready-made datasets for arrays (the fast
path: one vectorised gather per batch). `TorchDatasets` takes any map-style
`torch.utils.data.Dataset` per split instead (per-item `__getitem__`, transforms, a Hugging Face
`datasets.Dataset`), batched by a `collate_fn` in DataLoader workers.
`TrainData` and `EvalData` (view.py) tie a source to a sampler policy (policies.py).

Every source here is real and needs no download: scikit-learn's digits and diabetes ship inside
its package, the text corpus is CPython's own pydoc_data.topics, and synthetic data is written
to disk by scripts/make_synthetic.py.

Where things are (what you edit is marked *):

* sources.py*: `DataSource` (a base with the defaults) and the example sources (Digits,
  Diabetes, CharText, InMemoryArrays, TorchDatasets; `split_digits`, the digits' one split,
  which the examples' digit datasets share); files.py*: `SyntheticArrays`, shards on disk. Copy
  one.
* datasets.py: `Rows`, `TokenWindows`, what `load` returns; checks.py: `check_loaded`.
* policies.py*: the sampler policies (`Strided`, `Sharded`; a policy of yours subclasses
  `SamplerPolicy` and is chosen by `sampler._target_` in a conf/sampler/ YAML);
  sampling.py: the samplers they return (`EpochSampler`); permutation.py: the shuffle.
* view.py: a rank's view (`TrainData`, `EvalData`, `loader`); eval_batches.py: evaluation
  batches that line up across ranks; epoch_rows.py: what a resume that changes the sampler
  reads twice or skips; split_record.py: which rows are training rows, as a checkpoint records
  them (a source's optional `origin(split)`).
"""

from hydra_ddp.data.checks import check_loaded
from hydra_ddp.data.datasets import SPLITS, Origin, Rows, TokenWindows
from hydra_ddp.data.files import SyntheticArrays
from hydra_ddp.data.policies import SamplerPolicy, Sharded, Strided
from hydra_ddp.data.sources import (
    CharText,
    DataSource,
    Diabetes,
    Digits,
    InMemoryArrays,
    TorchDatasets,
    check_fractions,
    check_source,
    split_digits,
)
from hydra_ddp.data.view import EvalData, TrainData, check_sampling, loader
from hydra_ddp.protocols import Ranges

__all__ = [
    "SPLITS", "CharText", "DataSource", "Diabetes", "Digits", "EvalData", "InMemoryArrays",
    "Origin", "Ranges", "Rows", "SamplerPolicy", "Sharded", "Strided", "SyntheticArrays",
    "TokenWindows", "TorchDatasets", "TrainData", "check_fractions", "check_loaded",
    "check_sampling", "check_source", "loader", "split_digits",
]  # fmt: skip
