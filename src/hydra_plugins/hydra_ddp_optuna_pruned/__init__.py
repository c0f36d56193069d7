"""`hydra/sweeper=optuna_pruned`: an Optuna search whose trials report as they train and whose
losers stop early.

Hydra's Optuna sweeper hands Optuna whole trials (ask, run the job, tell its final value), so
no pruner can act. This one asks and tells the same way, through Optuna's ask-and-tell API,
but each job is told its trial (hydra_ddp.loop.pruning): it reports trainer.monitor at every
evaluation and asks the study's pruner whether to go on; a pruned job checkpoints and ends,
and its trial is told PRUNED. The study lives in a database (SQLite in the sweep dir unless
`hydra.sweeper.storage` names another), so the same command continues a stopped sweep.

A Hydra plugin lives under `hydra_plugins` (Hydra discovers sweepers there only). Its settings
and their defaults: config.py; the preset users choose: conf/hydra/sweeper/optuna_pruned.yaml.
"""
