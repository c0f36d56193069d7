"""hydra-ddp: a Hydra-configured research training template for PyTorch DDP and FSDP2.

Entry points: `train`, `eval`, `export`, `check`, `plan`; `config` is the typed schema of the
template's own keys and `components` builds what a `_target_` names. What you copy and edit:
`models`, `losses`, `metrics`, `optim`, `callbacks`, `step`, the sources in `data` and
`examples/`. The machinery is one package per part (`loop/`, `data/`, `checkpoint/`,
`tracking/`, `distributed/`, `rundir/`, `launch/`); the README's map has every module.
"""

__version__ = "0.1.0"
