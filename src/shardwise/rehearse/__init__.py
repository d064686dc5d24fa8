"""Rehearse a run at its real size on one machine.

Each played rank is a process of its own (``launch``) that joins torch's ``fake`` process group at
the full world size and goes through the real ``Session`` (``worker``): the model is built on the
meta device, parallelised outside ``FakeTensorMode`` (FSDP2's TP spec computes mesh coordinates
with a real ``nonzero``), and allocated as fake tensors inside it; then several real training steps
run under torch's trackers (``measure``). ``compare`` sets the measured bytes next to the
planner's per-rank prediction (the one ``train --dry-run`` prints), ``report`` writes the verdict,
and ``cli`` is ``shardwise rehearse``.
"""
