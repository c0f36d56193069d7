"""The run directory: who may write there (`claim`), where jobs write (`paths`), what made a
result (`provenance`), the JSON side files (`jsonfile`), and the sweep report (`sweeps`, with
`sweep_jobs` and `seed_groups`).
"""
