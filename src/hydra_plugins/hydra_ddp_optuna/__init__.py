"""`hydra/sweeper=optuna` and `optuna_pruned`: an Optuna search whose trials are whole DDP jobs,
on Optuna's ask-and-tell API, its study in a storage so the same command continues it. (Hydra
finds sweepers under `hydra_plugins` only; keys in sweeper.py, presets in conf/hydra/sweeper/.)
"""
