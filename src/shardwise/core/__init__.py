"""The torch-free core: what a run is, before any process or tensor exists.

``config`` (the typed run configuration and its one validation), ``config_version`` (what an older
config.toml meant), ``strategies`` (the strategy table), ``families`` (the model families and what
each supports), ``layout`` (the degrees of one run and every rule on them), ``pp_schedules`` (the
pipeline schedules' facts) and ``run_files`` (the names inside a run directory). Nothing here
imports torch (``tests/test_layout.py`` checks it): the launcher, the planner and ``--help`` read
these first. Outside this package it reads only ``errors`` and the torch-free names it validates
against (``optim.names``, ``optim.schedule``, ``habits``).
"""
