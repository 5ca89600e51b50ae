"""The tier table (kvtier/tiers.py): one row per kind, and each kind's stand-in sizes entries and holds
capacity exactly as the real tier does, so a trace-mode run's waterfall decides as a real one would."""

from __future__ import annotations

import pytest

from kvtier.config.tiers import DEFAULT_TIER_ORDER
from kvtier.engine.backend import ALIGN
from kvtier.errors import ConfigError
from kvtier.tiers import ALIGN as TABLE_ALIGN
from kvtier.tiers import KINDS, TierSpec, open_tier, stand_in
from kvtier.tracefile import TIER_BY_NUMBER, TIER_LABELS

SIZES = [1, ALIGN - 1, ALIGN, 3_000_001, 37 * 1024**2 + 5]


def test_the_table_is_the_one_list_of_kinds():
    assert TABLE_ALIGN == ALIGN
    assert tuple(KINDS) == DEFAULT_TIER_ORDER == ("gpu", "cpu", "cxl", "redis", "storage", "s3")
    assert TIER_LABELS == {k: f"Tier-{v.trace_number}" for k, v in KINDS.items()}
    assert sorted(TIER_BY_NUMBER) == [0, 1, 2, 3, 4, 5] and TIER_BY_NUMBER[2] == "storage"


@pytest.mark.parametrize("page", [ALIGN, 2 * 1024**2, 5 * 1024**2 + 123])
def test_the_cpu_stand_in_holds_and_sizes_as_the_paged_tier(page):
    spec = TierSpec(300 * 1024**2 + 77, page_bytes=page)
    real, fake = open_tier("cpu", spec), stand_in("cpu", spec)
    try:
        assert fake.capacity_bytes == real.capacity_bytes
        assert [fake.stored_size(n) for n in SIZES] == [real.stored_size(n) for n in SIZES]
    finally:
        real.close()


def test_the_storage_stand_in_sizes_as_the_file_tier(tmp_path):
    spec = TierSpec(1024**3, directory=str(tmp_path))
    real, fake = open_tier("storage", spec), stand_in("storage", spec)
    try:
        assert fake.capacity_bytes == real.capacity_bytes == 1024**3
        assert [fake.stored_size(n) for n in SIZES] == [real.stored_size(n) for n in SIZES]
    finally:
        real.close()


def test_a_tier_that_cannot_be_built_names_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="^--cache-dir: .*does not exist"):
        open_tier("storage", TierSpec(1024**2, directory=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="^--nvme-dir: "):
        open_tier("storage", TierSpec(1024**2, directory=str(tmp_path / "missing")), "--nvme-dir")
