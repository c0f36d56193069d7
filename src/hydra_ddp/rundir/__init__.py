"""The run directory: everything a job writes beside its checkpoints, and who may write there.

- `claim`: one job per run dir (a lock file that names its holder).
- `paths`: where a job writes, and the `${...}` resolvers that name run dirs.
- `provenance`: `run.json`, what ran (code, versions, machines, every rank's environment).
- `jsonfile`: the JSON side files, written atomically and read with one clear error.
- `sweeps`: the sweep report's Hydra callback (`sweep_report.json`), its journal, its checks;
  `sweep_jobs`: the sweep's jobs, one row each; `seed_groups`: a sweep over seeds by group.
"""
