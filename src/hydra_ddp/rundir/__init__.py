"""The run directory: everything a job writes beside its checkpoints, and who may write there.

- `claim`: one job per run dir (a lock file that names its holder).
- `paths`: where a job writes, and the `${...}` resolvers that name run dirs.
- `provenance`: `run.json`, what ran (code, versions, machines, every rank's environment).
- `jsonfile`: the JSON side files, written atomically and read with one clear error.
- `sweeps`: a sweep's report (`sweep.json`), one row per job.
"""
