"""`hydra/launcher=ray`: a sweep's jobs side by side, scheduled by Ray. Each job is a Ray task
asking for its ranks' CPUs (and GPUs), which starts the job as a fresh interpreter: nothing one
job imports or sets reaches the next. (Hydra finds launchers under `hydra_plugins` only;
settings in conf/hydra/launcher/ray.yaml.)
"""
