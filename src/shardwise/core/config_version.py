"""What a config file's ``config_version`` says, and how an older file is read (torch-free).

Every resolved ``config.toml`` a run writes carries ``config_version = CONFIG_VERSION``. A change of
a key's meaning bumps it, and ``upgrade`` reads an older file in today's meaning, or refuses it with
what changed, so that a saved run's config is never silently reinterpreted.

Version 2: ``parallel.dp_shard`` excludes ``parallel.cp`` (torchtitan's arithmetic,
dp_replicate x dp_shard x cp x tp x pp = world size). Before, dp_shard counted the cp ranks too
(``dp_shard=4 cp=2`` on 4 ranks is today's ``dp_shard=2 cp=2``). Only files that give both cp > 1
and dp_shard > 0 read differently; the others are the same under both versions.
"""

from __future__ import annotations

import sys
from typing import Any

from shardwise.errors import ConfigError

__all__ = ["CONFIG_VERSION", "upgrade"]

CONFIG_VERSION = 2


def _is_run_config(raw: dict[str, Any]) -> bool:
    """Whether ``raw`` is a run directory's resolved config.toml: every run writes its out_dir and
    parallel.nproc into it (job/train.py); a hand-written file seldom sets both."""
    parallel = raw.get("parallel")
    return bool(raw.get("out_dir")) and isinstance(parallel, dict) and bool(parallel.get("nproc"))


def upgrade(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """Return the raw dict of the config file ``where`` in today's meaning (a new dict when changed).

    An unversioned file is one written before versions existed (version 1) or by hand. Where the two
    meanings differ (cp > 1 with dp_shard > 0), a run's own config.toml is converted, with a note on
    stderr; a hand-written file is refused with the one line that settles it.
    """
    version = raw.get("config_version")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)
                                or not 1 <= version <= CONFIG_VERSION):
        raise ConfigError(
            f"{where} has config_version = {version!r}; this shardwise reads versions 1 to {CONFIG_VERSION}. "
            "A newer shardwise wrote it: upgrade shardwise, or write the file again without the key.")
    parallel = raw.get("parallel")
    if version == CONFIG_VERSION or not isinstance(parallel, dict):
        return raw
    cp, dp_shard = parallel.get("cp", 1), parallel.get("dp_shard", 0)
    if not (isinstance(cp, int) and isinstance(dp_shard, int) and cp > 1 and dp_shard > 0):
        return raw  # both versions read it the same
    if version is None and not _is_run_config(raw):
        raise ConfigError(
            f"{where} sets parallel.dp_shard = {dp_shard} with parallel.cp = {cp} and has no config_version. "
            "dp_shard excludes cp since config_version 2 (torchtitan's meaning: dp_replicate x dp_shard x cp "
            "x tp x pp = world size); before, it counted the cp ranks too. Add `config_version = 2` at the top "
            f"of the file if dp_shard = {dp_shard} means the ranks besides cp, or write dp_shard = "
            f"{dp_shard // cp if dp_shard % cp == 0 else dp_shard / cp} with config_version = 2 if it counted them.")
    if dp_shard % cp:
        raise ConfigError(
            f"{where} was written before config_version 2 with parallel.dp_shard = {dp_shard} counting the "
            f"parallel.cp = {cp} ranks, which it must then be a multiple of. Fix dp_shard (today it excludes cp) "
            "and add config_version = 2.")
    new = dp_shard // cp
    print(f"note: {where} was written before config_version 2, when parallel.dp_shard counted the cp ranks; "
          f"read as dp_shard = {new} x cp = {cp} (the same layout: dp_shard now excludes cp).", file=sys.stderr)
    return {**raw, "config_version": CONFIG_VERSION, "parallel": {**parallel, "dp_shard": new}}
