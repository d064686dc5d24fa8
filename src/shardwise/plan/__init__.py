"""``shardwise plan``: will it fit, and how should I split it? Pure arithmetic, no process group.

Layers, each one job:

* :mod:`.spec` — :class:`ModelSpec`, the model's shape (from a preset, an HF ``config.json``, a
  ``GPTConfig``, an ``nn.Module`` built on the meta device, or a bare parameter count);
* :mod:`.presets` — built-in models, the GPU catalog, link presets;
* :mod:`.memory` — per-rank bytes for every strategy (model state, activations, transients);
* :mod:`.cost` — FLOPs, compute / communication / bubble time, MFU;
* :mod:`.advice` — candidate strategies, fit, the recommendation and the commands to run it;
* :mod:`.cli` — the ``plan`` sub-command.

Conventions are written down in ``docs/planner.md``. The package re-exports nothing: import from
the module that owns a name (``shardwise.plan.search.make_plan``), so no import runs in circles.
"""
