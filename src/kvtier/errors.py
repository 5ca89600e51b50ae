"""The error tree of kvtier.

    KvtierError                 base of everything we raise on purpose
    ├── ConfigError             bad flag, config key or value (names the key path)
    ├── DatasetError            missing, empty or malformed input file (names file and line)
    ├── StorageError            a tier cannot do what was asked
    │   ├── UnusableDirectory   a file tier's directory is missing, unwritable or refuses O_DIRECT
    │   ├── TierFullError       no room even after eviction (capacity, ENOSPC)
    │   │   └── HostMemoryShort a RAM tier stopped growing: the host ran short of memory
    │   ├── EntryNotFound       key is not stored in that tier
    │   ├── TierUnavailable     a remote tier's server cannot be reached (Redis, S3): the run stops, partial
    │   └── Cancelled           the store's cancel event was set mid-operation (end of run)
    ├── UnsupportedError        a feature needs hardware or an extra that is not present
    └── LaunchError             a process of `kvtier launch` did not start or become healthy

The CLI maps each class to one line on stderr and an exit code (see ``EXIT_CODES``).
Library code translates OS errors at the boundary with ``raise ... from``. The engine's errors name
no flag (it serves bench, sim and the cache server alike); the layer that read the flag re-raises
them as a ConfigError naming it (``--cache-dir``, ``--nvme-dir``).
"""

from __future__ import annotations


class KvtierError(Exception):
    """Base class of all deliberate kvtier errors."""


class ConfigError(KvtierError):
    """A configuration value is invalid; the message names the key path or flag."""


class DatasetError(KvtierError):
    """An input dataset is missing, empty or malformed; the message names file and line."""


class StorageError(KvtierError):
    """A storage tier failed an operation."""


class UnusableDirectory(StorageError):
    """A file tier cannot use its directory; ``direct_io`` is True when O_DIRECT was required but refused."""

    def __init__(self, message: str, direct_io: bool = False) -> None:
        super().__init__(message)
        self.direct_io = direct_io


class TierFullError(StorageError):
    """A tier has no room for an entry, even after eviction."""


class HostMemoryShort(TierFullError):
    """A RAM tier needed fresh pages while the host was short of memory: it has stopped growing at the pages it
    already holds (its ``capacity_bytes`` is smaller now). The store takes the new size and makes room within it."""


class TierUnavailable(StorageError):
    """A remote tier's server cannot be reached (refused, reset, timed out). Unlike a failed
    operation it will not heal by itself within the run: the bench stops as partial."""


class EntryNotFound(StorageError):
    """The key is not present in the tier."""


class ForeignEntry(StorageError):
    """A shared namespace holds something under the key that is not the entry the key names: its size or part
    count is not the expected entry's, or its description is malformed or unbounded (an expiry that is not a
    finite time within the TTL limit). Nothing of it is read; the lookup is a miss counted as ``foreign-entry``,
    never a hit."""


class Cancelled(StorageError):
    """An operation stopped early because the run is ending; nothing of it is kept.

    ``bytes_done`` is how many payload bytes had already moved (they reached the device and the
    kernel's I/O counters, so the result reports them apart from completed work)."""

    def __init__(self, message: str, bytes_done: int = 0) -> None:
        super().__init__(message)
        self.bytes_done = bytes_done


class UnsupportedError(KvtierError):
    """The request needs hardware or an optional dependency that is not available."""


class Interrupted(KeyboardInterrupt):
    """A library run that SIGINT or SIGTERM stopped. Its partial result was written where the config said and is
    ``result`` (status partial, stop reason interrupted or terminated); raised, so a script that called the run
    stops as it would on Ctrl+C instead of carrying on with a partial result it may not look at."""

    def __init__(self, result: object, message: str) -> None:
        super().__init__(message)
        self.result = result


class LaunchError(KvtierError):
    """A process of a launch failed to start or to become healthy; the message names its log."""


EXIT_CODES: dict[type[KvtierError], int] = {
    ConfigError: 2,
    DatasetError: 3,
    UnsupportedError: 4,
    StorageError: 5,
    LaunchError: 6,
    KvtierError: 1,
}


def exit_code_for(exc: KvtierError) -> int:
    """Most specific exit code for an error instance."""
    for cls in type(exc).__mro__:
        if cls in EXIT_CODES:
            return EXIT_CODES[cls]
    return 1
