"""The engine's configs, importable as the package hydra_ddp.conf: a thin project layers its own
configs over these with `hydra.searchpath: [pkg://hydra_ddp.conf]`. An editable install finds
the package only through this file (setuptools maps no namespace package below hydra_ddp).
"""
