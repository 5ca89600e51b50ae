"""#43 item 5: the tier table carries each kind's properties, so a new remote kind touches three files (its engine
module, its row in kvtier/tiers.py, its flags in config/tiers.py) and nothing else names the remote kinds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kvtier
from kvtier.config.bench import BenchConfig
from kvtier.config.sim import CacheServerConfig, SimConfig
from kvtier.config.tiers import RemoteTierFlags
from kvtier.errors import ConfigError
from kvtier.tiers import KINDS, OFFLOAD_KINDS, REMOTE_KINDS, configured_remote, is_remote, offload_plan

SRC = Path(kvtier.__file__).parent
ALLOWED = {"tiers.py", "config/tiers.py", "engine/redis_tier.py", "engine/s3_tier.py"}


def test_the_remote_kinds_are_named_only_by_the_tier_table_their_flags_and_their_modules():
    found = []
    for f in sorted(SRC.rglob("*.py")):
        rel = str(f.relative_to(SRC))
        if rel in ALLOWED:
            continue
        text = f.read_text()
        for kind in REMOTE_KINDS:
            if re.search(rf"""["']{kind}["']""", text):
                found.append(f"{rel}: {kind!r}")
    assert not found, found


def test_the_table_says_which_kinds_are_remote_and_what_configures_them():
    assert REMOTE_KINDS == ("redis", "s3") and OFFLOAD_KINDS == ("cpu", "nvme", "redis", "s3")
    assert is_remote("s3") and not is_remote("storage") and not is_remote("nvme")
    flags = RemoteTierFlags(redis_url="redis://127.0.0.1:1/0", redis_mem_gb=2, s3_bucket="kv-cache", s3_capacity_gb=3)
    assert configured_remote(flags) == ["redis", "s3"] and configured_remote(RemoteTierFlags()) == []
    assert flags.remote_capacity_bytes("redis") == 2 * 2**30 and flags.remote_capacity_bytes("s3") == 3 * 2**30
    assert [KINDS[k].entries for k in REMOTE_KINDS] == ["keys", "objects"]
    cfg = BenchConfig(s3_bucket="kv-cache", s3_capacity_gb=1, cpu_mem_gb=0)
    assert cfg.configured_tiers() == ["gpu", "storage", "s3"]  # the table's order; CPU off at 0 GB


def test_an_offload_of_a_remote_kind_its_flags_do_not_configure_says_what_it_needs():
    with pytest.raises(ConfigError, match="--offload s3: give --s3-bucket"):
        offload_plan("s3", page_bytes=4096, cpu_bytes=0, staging_bytes=1 << 20, nvme_dir=None, nvme_bytes=0,
                     remote=RemoteTierFlags())  # fmt: skip
    with pytest.raises(ConfigError, match="expected cpu, nvme, redis, s3"):
        offload_plan("tape", page_bytes=4096, cpu_bytes=0, staging_bytes=0, nvme_dir=None, nvme_bytes=0)


def test_the_offload_choices_come_from_the_table():
    with pytest.raises(ValueError, match="'cpu', 'nvme', 'redis' or 's3'"):
        CacheServerConfig(socket="/tmp/x.sock", offload="tape")
    assert SimConfig(offload="remote", cache_server="/tmp/x.sock").offload == "remote"
