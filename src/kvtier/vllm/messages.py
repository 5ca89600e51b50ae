"""The cache server's wire messages (vllm/protocol.py carries them as framed JSON), one model per operation.

Requests are discriminated by ``op``: the server validates each one before acting (a wrong field is a refusal naming
it, never a KeyError in a handler), the client builds them typed. Replies are checked by the client the same way:
counts are non-negative integers, statuses one of three words, so a confused or hostile server cannot hand the
engine a negative count or a tier index it does not have.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter, ValidationError, model_validator

from kvtier.vllm.protocol import MAX_KEYS

Key = Annotated[str, StringConstraints(min_length=1, max_length=1024)]
Keys = Annotated[list[Key], Field(max_length=MAX_KEYS)]
Count = Annotated[int, Field(ge=0)]
TierName = Annotated[str, StringConstraints(max_length=64)]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Hello(_Message):
    """The first message of every connection: its role, the engine's name and its block geometry (an ``admin``
    connection, ``kvtier cache-server flush``, has none: it moves no block)."""

    op: Literal["hello"] = "hello"
    role: Literal["control", "probe", "data", "admin"]
    engine: Annotated[str, StringConstraints(max_length=256)] = "?"
    block_bytes: int | None = Field(None, gt=0, le=1 << 32)  # one worker's share of a block: at most 4 GiB
    block_tokens: int | None = Field(None, gt=0)
    world_size: int | None = Field(None, gt=0, le=1024)
    rank: int | None = Field(None, ge=0)  # data: the worker's rank (its share of each block)
    proof: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")] | None = None  # TCP: HMAC of the challenge
    # what every key of this connection starts with (keys.key_prefix: a model's): its lookups, stores, loads,
    # forgets and resets stay within it, so one model's engine cannot drop another's blocks. None: every key
    scope: Annotated[str, StringConstraints(max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")] | None = None

    @model_validator(mode="after")
    def _geometry(self) -> Hello:
        if self.role != "admin" and None in (self.block_bytes, self.block_tokens, self.world_size):
            raise ValueError(f"role {self.role} needs block_bytes, block_tokens and world_size")
        return self


@dataclass(frozen=True)
class BlockGeometry:
    block_bytes: int  # one worker's share of a block
    block_tokens: int
    world_size: int

    @classmethod
    def of(cls, hello: Hello) -> BlockGeometry:
        assert hello.block_bytes and hello.block_tokens and hello.world_size  # every role but admin has them
        return cls(hello.block_bytes, hello.block_tokens, hello.world_size)


def outside(scope: str, keys: Iterable[object]) -> str | None:
    """Why a request naming ``keys`` is refused on a connection scoped to ``scope`` (None: every key is in it)."""
    if not scope:
        return None
    bad = next((k for k in keys if not str(k).startswith(scope)), None)
    return None if bad is None else f"key {str(bad)[:80]!r} is outside this connection's scope {scope!r}"


def cost(req: _Message) -> int:
    """What a request counts against its connection's allowance of keys (vllm/listen.py KeyRate): its keys; a reset
    or a flush, which scans the whole index, as a full request of MAX_KEYS; anything else, one."""
    if isinstance(req, (Reset, Flush)):
        return MAX_KEYS
    return len(getattr(req, "keys", ())) or 1


class _OnKeys(_Message):
    """A control request about some blocks, by key (each operation adds its ``op``)."""

    keys: Keys


class Lookup(_OnKeys):
    op: Literal["lookup"] = "lookup"


class Pin(_OnKeys):
    op: Literal["pin"] = "pin"


class Unpin(_OnKeys):
    op: Literal["unpin"] = "unpin"


class Touch(_OnKeys):
    op: Literal["touch"] = "touch"


class PlanStore(_OnKeys):
    op: Literal["plan"] = "plan"
    raw: Annotated[list[Annotated[str, StringConstraints(max_length=1024)]], Field(max_length=MAX_KEYS)] = []


class Complete(_OnKeys):
    op: Literal["complete"] = "complete"
    success: bool = True


class Forget(_OnKeys):
    op: Literal["forget"] = "forget"


class Reset(_Message):
    op: Literal["reset"] = "reset"


class Usage(_Message):
    op: Literal["usage"] = "usage"


class Flush(_Message):
    """Drop the idle blocks whose key starts with ``prefix`` (``keys.key_prefix``: a model, or one revision of it)."""

    op: Literal["flush"] = "flush"
    prefix: Annotated[str, StringConstraints(pattern=r"^kvt[0-9]+_[a-z0-9-]+_(r-[a-z0-9-]+_)?$", max_length=128)]


class Put(_Message):
    op: Literal["put"] = "put"
    key: Key


class Get(_Message):
    op: Literal["get"] = "get"
    key: Key


Control = Annotated[
    Lookup | Pin | Unpin | Touch | PlanStore | Complete | Forget | Reset | Usage, Field(discriminator="op")
]
Data = Annotated[Put | Get, Field(discriminator="op")]
Admin = Annotated[Flush | Usage, Field(discriminator="op")]
ADMIN: TypeAdapter[Admin] = TypeAdapter(Admin)
CONTROL: TypeAdapter[Control] = TypeAdapter(Control)
DATA: TypeAdapter[Data] = TypeAdapter(Data)


class _Reply(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    ok: Literal[True] = True


class TiersReply(_Reply):
    tiers: list[tuple[TierName, Count, TierName]] = []  # (name, blocks it holds, vLLM by-source label), fastest first


class LookupReply(_Reply):
    found: list[tuple[Literal["hit", "pending", "miss"], Count | None]]  # per key: status, tier index


class PinReply(_Reply):
    pinned: Count


class Done(_Reply):
    """unpin, touch: nothing to say."""


class PlanReply(_Reply):
    none: bool = False  # nothing to store (all held, pending or rejected)
    rejected: Count = 0
    store: list[str] = []
    placed: list[Count] = []
    evicted: list[Annotated[str, StringConstraints(pattern=r"^([0-9a-f]{2})*$", max_length=1024)]] = []  # raw keys, hex
    demoted: dict[str, Count] = {}
    evicted_by: dict[str, Count] = {}


class CompleteReply(_Reply):
    failed: Count


class ForgetReply(_Reply):
    forgotten: Count


class ResetReply(_Reply):
    dropped: Count


class FlushReply(_Reply):
    dropped: Count  # blocks dropped from the index and the tiers
    busy: Count  # matching blocks left because a load or a store of theirs is in flight (flush again later)


class UsageReply(_Reply):
    usage: dict[str, tuple[Count, Count]]  # tier: (blocks held, slots)


class PutReply(_Reply):
    tier: TierName
    seconds: float = Field(ge=0)


class GetReply(_Reply):
    hit: bool
    tier: TierName | None = None
    n: Count = 0
    seconds: float = Field(0.0, ge=0)
    why: str = ""


def refusal(e: ValidationError) -> str:
    """A request that is not one of the operations, as a sentence naming the field."""
    err = e.errors()[0]
    where = ".".join(str(x) for x in err["loc"])
    if err["type"] == "union_tag_invalid":
        return f"unknown op {err.get('input', {}).get('op') if isinstance(err.get('input'), dict) else '?'!r}"
    return f"{where or 'message'}: {err['msg']}"


__all__ = [
    "BlockGeometry",
    "outside",
    "ADMIN",
    "CONTROL",
    "Flush",
    "FlushReply",
    "DATA",
    "Complete",
    "CompleteReply",
    "Done",
    "Forget",
    "ForgetReply",
    "Get",
    "GetReply",
    "Hello",
    "Lookup",
    "LookupReply",
    "Pin",
    "PinReply",
    "PlanStore",
    "PlanReply",
    "Put",
    "PutReply",
    "Reset",
    "ResetReply",
    "TiersReply",
    "Touch",
    "Unpin",
    "Usage",
    "UsageReply",
    "refusal",
]
