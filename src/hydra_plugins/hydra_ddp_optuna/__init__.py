"""`hydra/sweeper=optuna` and `hydra/sweeper=optuna_pruned`: an Optuna search whose trials are
whole DDP jobs, on Optuna's ask-and-tell API. With a pruner, each job reports trainer.monitor at
its evaluations and stops when the pruner says so (hydra_ddp.loop.pruning). The study lives in a
storage (SQLite in the sweep dir by default), so the same command continues a stopped sweep.

A Hydra plugin lives under `hydra_plugins` (Hydra discovers sweepers there only). Not meant to be
edited by a user of the template: its keys and their defaults are in sweeper.py, the presets in
conf/hydra/sweeper/.
"""
