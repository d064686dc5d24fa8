"""Parallelism applied from outside the model: one small module per strategy.

The strategy table is ``shardwise.core.strategies`` (torch-free); ``parallel.implementations.get_strategy``
binds a layout to the class that runs it. Import what you need from its module: the package
re-exports nothing, so importing one module never imports its siblings (no import circles).
"""
