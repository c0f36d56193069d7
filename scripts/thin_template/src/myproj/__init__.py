"""myproj: a training project on the hydra-ddp engine.

Yours to edit: `model` (the network), `data` (where rows come from), `loss` (the objective),
`callbacks` (per-step work of your own), and `conf/` (one YAML per choice, layered over the
engine's configs). `train` is the entry; the loop, DDP, checkpoints and logging come from the
engine, which this package reaches only through `hydra_ddp.api`.
"""
