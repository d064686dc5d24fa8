"""Shared pieces of the test suite, importable as ``tests.helpers.*`` (also by spawned ranks).

* ``dist`` — rank functions for the harness and DDP tests;
* ``sharding`` — the data-parallel sharding tests' rank functions;
* ``mp`` — the model-parallel (TP/PP and compositions) rank functions;
* ``ckpt`` — checkpoint / resume / elastic / watchdog pieces (small corpus, CLI runner);
* ``models`` — a user's own model and data (model.factory / data.factory targets);
* ``benchmarks`` — a ``benchmarks/`` script imported as a module (its tables and helpers).

The fixed-batch training loop they all use is ``shardwise.testing.train_fixed_batches``.
"""
