"""Sharded checkpoints on PyTorch DCP: atomic publish, checksummed manifest, resharding, export.

Layout of a checkpoints root (``<run>/checkpoints``)::

    step-00000200/            one complete checkpoint
        __0_0.distcp ...      DCP shards, each written by the rank that owns the data
        .metadata             DCP's index (a pickle: see "Security" below)
        rng-rank0.json ...    each rank's RNG streams and loss-scaler state (plain JSON)
        manifest.json         written last: step, strategy, world size, model fingerprint, data
                              position, LR scheduler state, user state, and the size + SHA-256
                              of every other file
    latest                    the name of the newest complete checkpoint, written after publish
    .partial-step-00000400/   a checkpoint being written; never read, removed on the next save

Every rank writes into ``.partial-step-N``; once every shard is on disk, rank 0 writes the
manifest and renames the directory to ``step-N`` (a rename is atomic on POSIX file systems), then
replaces ``latest``. A kill at any point therefore leaves ``latest`` naming the previous complete
checkpoint, and a partial directory is never mistaken for one.

Model and optimizer state go through ``torch.distributed.checkpoint.state_dict.get_state_dict`` /
``set_state_dict``, whose keys are the plain model's parameter names whatever the wrapping (DDP,
FSDP2, DTensor TP), and DCP reshards on load: a checkpoint saved by any strategy on any number of
ranks loads into any other.

Security: nothing read from a checkpoint can run code. Tensors are read by DCP with
``torch.load(weights_only=True)``; DCP's non-tensor entries (optimizer hyper-parameters) are
normally read with ``weights_only=False``, so ``SafeLoadPlanner`` reads them with
``weights_only=True``; DCP's ``.metadata`` is a plain pickle, so ``SafeFileSystemReader`` checks its
SHA-256 against the manifest and then unpickles it with an allow-list of DCP's own metadata classes
(any other global is refused). RNG states, scaler state and the manifest are JSON.

Modules, one job each: ``manifest`` (names, the manifest, checksums, the model fingerprint),
``safe_read`` (DCP metadata and entries read without running code), ``locate`` (finding complete
checkpoints, ``latest``, rotation), ``state`` (name-keyed model/optimizer state dicts), ``pieces``
(what a checkpoint holds: a dict of named Stateful pieces, each stored in DCP, in the manifest or in
the per-rank file; adding one is one entry, see its docstring and docs/checkpoints.md), ``save``,
``load``, ``export`` (inspect, consolidate, write weights), ``hf_export`` (Hugging Face and PEFT
folders), ``preflight`` (checks before launch), ``engines`` (who writes the tensors: PyTorch DCP, or
an engine with files of its own behind one interface, ``deepspeed_engine``) and ``background``
(asynchronous saves). The package re-exports nothing: import from the module that owns a name.
"""
