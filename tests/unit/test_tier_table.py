"""#43 item 5: the tier table carries each kind's properties, so a new remote kind touches three files (its engine
module, its row in kvtier/tiers.py, its flags in config/tiers.py) and nothing else names the remote kinds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kvtier
from kvtier.config.bench import BenchConfig
from kvtier.config.sim import CacheServerConfig, OffloadTierConfig, SimConfig
from kvtier.config.tiers import RemoteTierFlags
from kvtier.errors import ConfigError
from kvtier.tiers import (
    KINDS,
    OFFLOAD_KINDS,
    REMOTE_KINDS,
    Ask,
    configured_kinds,
    configured_remote,
    is_remote,
    offload_plan,
)

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
    assert REMOTE_KINDS == ("redis", "s3") and OFFLOAD_KINDS == ("cpu", "cxl", "redis", "nvme", "s3")
    assert is_remote("s3") and not is_remote("storage") and not is_remote("nvme")
    flags = RemoteTierFlags(redis_url="redis://127.0.0.1:1/0", redis_mem_gb=2, s3_bucket="kv-cache", s3_capacity_gb=3)
    assert configured_remote(flags) == ["redis", "s3"] and configured_remote(RemoteTierFlags()) == []
    assert flags.remote_capacity_bytes("redis") == 2 * 2**30 and flags.remote_capacity_bytes("s3") == 3 * 2**30
    assert [KINDS[k].entries for k in REMOTE_KINDS] == ["keys", "objects"]
    cfg = BenchConfig(s3_bucket="kv-cache", s3_capacity_gb=1, cpu_mem_gb=0)
    assert cfg.configured_tiers() == ["gpu", "storage", "s3"]  # the table's order; CPU off at 0 GB


def test_an_offload_of_a_remote_kind_its_flags_do_not_configure_says_what_it_needs():
    with pytest.raises(ConfigError, match="--offload s3: give --s3-bucket"):
        offload_plan("s3", OffloadTierConfig(), Ask(page_bytes=4096))
    with pytest.raises(ConfigError, match="expected cpu, cxl, redis, nvme, s3"):
        offload_plan("tape", OffloadTierConfig(), Ask(page_bytes=4096))


def test_the_offload_choices_come_from_the_table():
    with pytest.raises(ValueError, match="'cpu', 'cxl', 'redis', 'nvme' or 's3'"):
        CacheServerConfig(socket="/tmp/x.sock", offload="tape")
    assert SimConfig(offload="remote", cache_server="/tmp/x.sock").offload == "remote"


def test_every_kind_local_or_remote_is_one_row_that_every_chain_asks():
    """#54 item 1: the local kinds declare themselves as the remote ones do: what configures them in kvtier bench,
    the spec their flags build, the host RAM they take, whether they may be an offload tier (alone or staged) and
    under which --offload name, the tier kvtier trace replay runs their rows on, their vLLM by-source label."""
    bench = BenchConfig(gpu_mem_gb=0, cpu_mem_gb=0)
    assert configured_kinds(bench) == ["storage"]  # CPU off at 0 GB; the file tier always
    assert configured_kinds(BenchConfig(gpu_mem_gb=1, cpu_mem_gb=1)) == ["gpu", "cpu", "storage"]
    rows = {k.name: (k.offload, k.choice, k.replay_as, k.vllm_source, k.trace_label) for k in KINDS.values()}
    assert rows == {
        "gpu": ("", "gpu", "cpu", "gpu", "Tier-0"),
        "cpu": ("alone", "cpu", "cpu", "host", "Tier-1"),
        "cxl": ("alone", "cxl", "cpu", "host", "Tier-5"),
        "redis": ("staged", "redis", "", "external_unspecified", "Tier-3"),
        "storage": ("staged", "nvme", "storage", "disk", "Tier-2"),
        "s3": ("staged", "s3", "", "external_unspecified", "Tier-4"),
    }
    cpu = KINDS["cpu"].spec(BenchConfig(cpu_mem_gb=2), Ask(page_bytes=2**20, host_reserved_bytes=5))
    assert (cpu.capacity_bytes, cpu.page_bytes, cpu.host_reserved_bytes) == (2 * 2**30, 2**20, 5)
    assert KINDS["cpu"].host_bytes(cpu) == 2 * 2**30 and KINDS["storage"].host_bytes(cpu) == 0


def test_an_offload_plan_is_the_kind_alone_or_behind_a_cpu_staging_tier_each_workers_share():
    flags = OffloadTierConfig(cpu_offload_gb=1, staging_gb=0.5, nvme_dir="/nv", nvme_offload_gb=8)
    ((kind, spec, where),) = offload_plan("cpu", flags, Ask(page_bytes=4096, share=2))
    assert (kind, spec.capacity_bytes, spec.page_bytes, where) == ("cpu", 2**29, 4096, "cpu_offload_gb")
    staging, nvme = offload_plan("nvme", flags, Ask(page_bytes=4096, share=2))
    assert (staging[0], staging[1].capacity_bytes, staging[2]) == ("cpu", 2**28, "staging_gb")
    assert (nvme[0], nvme[1].capacity_bytes, nvme[1].directory, nvme[2]) == ("storage", 4 * 2**30, "/nv", "--nvme-dir")
    with pytest.raises(ConfigError, match="--offload nvme: give --nvme-dir"):
        offload_plan("nvme", OffloadTierConfig(), Ask())
    with pytest.raises(ConfigError, match="expected"):
        offload_plan("storage", flags, Ask())  # the medium's --offload spelling is nvme; gpu is never one
    with pytest.raises(ConfigError, match="expected"):
        offload_plan("gpu", flags, Ask())
