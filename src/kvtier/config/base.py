"""What every command's config shares: strict models, fields that are also flags, and error text.

A command's config is one pydantic model. Each field is a flag: ``--num-users`` is the field
``num_users`` (extra spellings in ``aliases``), its ``description`` is the ``--help`` text, and its
default is the flag's default — so the flag, the YAML key and the Python name cannot drift apart.
``cli/args.py`` builds the argparse parser from these models; nothing else declares a flag.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from kvtier.errors import ConfigError


class StrictModel(BaseModel):
    """Unknown keys are errors; assignments are validated like construction."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def flag(
    default: Any = ...,
    help: str = "",
    *,
    aliases: tuple[str, ...] = (),
    group: str | None = None,
    cli: bool = True,
    metavar: str | None = None,
    positional: bool = False,
    **constraints: Any,
) -> Any:
    """A config field that is also a command-line flag.

    ``help`` becomes the field's description and the flag's ``--help`` line; ``aliases`` are
    extra flag spellings (e.g. ``--num_users``); ``group`` names the help section; ``cli=False``
    keeps a field out of the parser (set by code or YAML only); ``positional=True`` makes it a bare argument
    (a list: one or more). ``constraints`` go to pydantic
    (``ge``, ``gt``, ``le``, ``min_length``, ``default_factory``...)."""
    extra: dict[str, Any] = {"cli": cli}
    if aliases:
        extra["aliases"] = list(aliases)
    if group:
        extra["group"] = group
    if metavar:
        extra["metavar"] = metavar
    if positional:
        extra["positional"] = True
    return Field(default, description=help, json_schema_extra=extra, **constraints)


DEFAULT_MAX_FAILURE_RATE = 0.01
"""--max-failure-rate's default: above 1 % of failed work a run is failed (results/outcome.py)."""


def max_failure_rate_flag(group: str | None = None) -> Any:
    """The one ``--max-failure-rate`` field every load-running command shares."""
    return flag(
        DEFAULT_MAX_FAILURE_RATE,
        "largest share of failed requests (0..1) a complete run may have; above it the run is failed (exit 1, "
        "stop code too-many-failures)",
        ge=0,
        le=1,
        group=group,
    )


def field_extra(info: FieldInfo) -> dict[str, Any]:
    extra = info.json_schema_extra
    return dict(extra) if isinstance(extra, dict) else {}


def flag_name(field: str) -> str:
    """``num_users`` -> ``--num-users``; a trailing underscore keeps a name off a keyword or a builtin
    (``from_`` -> ``--from``, ``json_`` -> ``--json``)."""
    return "--" + field.rstrip("_").replace("_", "-")


def format_validation_error(err: ValidationError, *, source: str = "", flags: bool = False, prefix: str = "") -> str:
    """One line per problem. ``flags=True`` names a top-level field as its flag (``--num-users``);
    otherwise as a key path (``eviction.target_usage_ratio``), after ``source`` (a file) if given."""
    lines = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key" if not flags or len(loc) > 1 else "unknown option"
        head = source + ": " if source else ""
        if not loc:  # a check across fields: its message names the flags itself
            lines.append(head + (f"{prefix.rstrip('.')}: {msg}" if prefix else msg))
            continue
        if flags:
            where = flag_name(loc[0]) + ("." + ".".join(loc[1:]) if len(loc) > 1 else "")
        else:
            where = prefix + ".".join(loc)
        lines.append(f"{head}{where}: {msg}")
    return "\n".join(lines)


M = TypeVar("M", bound=BaseModel)


def validate_config(model: type[M], values: dict[str, Any], *, source: str = "", flags: bool = True) -> M:
    """``model(**values)``, or a ConfigError naming every bad flag (or key, with ``flags=False``)."""
    try:
        return model.model_validate(values)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source=source, flags=flags)) from None


MAX_YAML_NODES = 100_000
"""Nodes a YAML document may expand to, aliases followed. A few hundred bytes of nested aliases (a
"billion laughs") expand to billions of nodes when walked; real configs have a few thousand."""


def load_yaml(text: str, source: str) -> Any:
    """``yaml.safe_load`` that refuses a document expanding (aliases followed) past MAX_YAML_NODES."""
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        sizes: dict[int, int] = {}

        def expanded(n: Any) -> int:  # memoised on the node: linear in the document, not in its expansion
            if id(n) in sizes:
                return sizes[id(n)]
            if isinstance(n, yaml.SequenceNode):
                size = 1 + sum(expanded(c) for c in n.value)
            elif isinstance(n, yaml.MappingNode):
                size = 1 + sum(expanded(k) + expanded(v) for k, v in n.value)
            else:
                size = 1
            sizes[id(n)] = min(size, MAX_YAML_NODES + 1)
            return sizes[id(n)]

        if expanded(node) > MAX_YAML_NODES:
            raise ConfigError(
                f"{source}: expands to more than {MAX_YAML_NODES} nodes once its aliases are followed: "
                "refused (an alias bomb)"
            )
        return loader.construct_document(node)
    finally:
        loader.dispose()


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into ``base`` (mappings merge key by key; anything else replaces)."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def config_argv(config: BaseModel) -> list[str]:
    """The command-line arguments that re-create ``config`` (fields that differ from their default)."""
    out: list[str] = []
    tail: list[str] = []  # positional fields' values, after the options
    for name, value in config.model_dump(mode="json", exclude_defaults=True).items():
        info = type(config).model_fields[name]
        if field_extra(info).get("cli") is False:
            continue
        if field_extra(info).get("positional"):
            tail += [str(v) for v in value] if isinstance(value, list) else [str(value)]
            continue
        opt = flag_name(name)
        if isinstance(value, bool):
            if value:
                out.append(opt)
        elif isinstance(value, list):
            for v in value:
                out += [opt, str(v)]
        elif value is not None:
            out += [opt, str(value)]
    return out + tail


__all__ = [
    "load_yaml",
    "MAX_YAML_NODES",
    "StrictModel",
    "flag",
    "DEFAULT_MAX_FAILURE_RATE",
    "max_failure_rate_flag",
    "field_extra",
    "flag_name",
    "format_validation_error",
    "validate_config",
    "deep_merge",
    "config_argv",
]
