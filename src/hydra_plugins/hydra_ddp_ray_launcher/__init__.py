"""`hydra/launcher=ray`: the jobs of a sweep run side by side, scheduled by Ray.

Each job is one Ray task that asks for the job's resources (its ranks' CPU share, and
`dist.nproc_per_node` GPUs on a GPU machine); Ray runs as many at once as the machine or cluster
holds and queues the rest. The task starts the job as a fresh interpreter, which runs it as
`python -m hydra_ddp.train dist.nproc_per_node=N` would: its own dir, own rendezvous port, own
W&B run, the sweep report's journal lines, its objective back to the sweeper; nothing one job
imports or sets reaches the next.

A Hydra plugin lives under `hydra_plugins` (Hydra discovers launchers there only). Not meant to
be edited by a user of the template; its settings are conf/hydra/launcher/ray.yaml.
"""
