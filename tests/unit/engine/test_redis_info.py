"""#41 item 6: a Redis server's INFO is data. ``maxmemory:abc`` gave a traceback, and terminal escapes in its version
or policy reached the terminal raw; now a field that is not what it should be is null, and text keeps printable
characters only. The tier's own start-up against a real redis-server is in tests/integration/test_remote_tiers.py."""

from __future__ import annotations

from kvtier.engine.redis_tier import _info, server_facts


def test_hostile_info_fields_are_null_or_cleaned_never_a_traceback():
    reply = (
        b"# Server\r\nredis_version:7.0\x1b[2J\x1b[31mpwned\r\nmaxmemory:abc\r\nused_memory:-5\r\n"
        b"maxmemory_policy:allkeys-lru\x07\x1b]0;title\x07\r\n"
    )
    f = server_facts(_info(reply))
    assert f["maxmemory_bytes"] is None and f["used_memory_bytes_at_start"] is None
    for text in (f["version"], f["maxmemory_policy"]):
        assert isinstance(text, str) and all(ch.isprintable() for ch in text), text
    assert f["version"].startswith("7.0") and f["maxmemory_policy"].startswith("allkeys-lru")


def test_honest_info_reads_as_before():
    f = server_facts(_info(b"redis_version:7.0.15\r\nmaxmemory:1073741824\r\nmaxmemory_policy:noeviction\r\n"))
    assert f == {"server": "redis", "version": "7.0.15", "maxmemory_bytes": 1 << 30,
                 "maxmemory_policy": "noeviction", "used_memory_bytes_at_start": None}  # fmt: skip


def test_a_long_version_is_cut():
    f = server_facts({"redis_version": "9" * 10_000})
    assert f["version"] is not None and len(f["version"]) <= 64
