"""The job's lifecycle around the ranks: launch agent, run directory and its lock, the job's
identity, multi-node rendezvous, the hang watchdog, the worker entry point, dying with the launcher,
failure reports and fault injection. The per-rank training runtime (Session, data, trainer,
checkpoints) is ``shardwise.runtime``; this package never trains.
"""
