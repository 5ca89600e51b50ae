"""Build argparse options from a config model, and turn parsed options back into that model.

Each field of the model becomes ``--field-name`` (plus its ``aliases``), with the field's
description as help and the field's default shown; ``Literal`` types become choices, ``bool``
fields switches, ``list`` fields repeatable options. Options the user did not give are left out of
the parsed namespace (argparse.SUPPRESS), so the model's own defaults apply — and, for bench, a
value in the YAML layout is not overridden by a flag's default.
"""

from __future__ import annotations

import argparse
import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from kvtier.config.base import M, field_extra, flag_name, validate_config


def _unwrap_optional(tp: Any) -> Any:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _default_text(default: Any) -> str:
    if default is None or default is PydanticUndefined or isinstance(default, bool) or default in ("", []):
        return ""
    return f" (default {default:g})" if isinstance(default, float) else f" (default {default})"


def add_config_arguments(parser: argparse.ArgumentParser, model: type[BaseModel], skip: tuple[str, ...] = ()) -> None:
    """Add one option per CLI field of ``model`` (fields with ``cli=False`` or in ``skip`` are left out)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    fields = sorted(model.model_fields.items(), key=lambda f: bool(field_extra(f[1]).get("group")))  # stable
    for name, info in fields:
        extra = field_extra(info)
        if name in skip or extra.get("cli") is False:
            continue
        tp = _unwrap_optional(info.annotation)
        help_text = (info.description or "").replace("%", "%%")  # argparse formats help with %
        if extra.get("positional"):  # a bare argument (kvtier report RESULT...): a list takes one or more
            many = get_origin(tp) is list
            meta = extra.get("metavar", name.upper())
            parser.add_argument(name, nargs="+" if many else None, metavar=meta, help=help_text)
            continue
        kw: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS}
        if tp is bool:
            kw["action"] = "store_true"
        elif get_origin(tp) is Literal:
            kw["choices"] = list(get_args(tp))
            help_text += _default_text(info.default)
        elif get_origin(tp) is list:
            (inner,) = get_args(tp)
            kw["action"] = "append"
            # numbers are taken as text: the model splits "256,1024" and checks each value (one error for both forms)
            kw["type"] = str if inner in (int, float) else inner
            help_text += " (repeat for several)"
        elif tp in (int, float, str):
            kw["type"] = tp
            help_text += _default_text(info.default)
        else:
            raise TypeError(f"{model.__name__}.{name}: no command-line form for {tp!r}")
        if "metavar" in extra:
            kw["metavar"] = extra["metavar"]
        elif name.endswith("_") and tp is not bool:  # from_ is --from FROM, not FROM_
            kw["metavar"] = name.rstrip("_").upper()
        if info.is_required():
            kw["required"] = True
        target: argparse._ActionsContainer = parser
        if extra.get("group"):
            target = groups.setdefault(extra["group"], parser.add_argument_group(extra["group"]))
        target.add_argument(flag_name(name), *extra.get("aliases", []), help=help_text, **kw)


def config_values(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """The options the user gave, by field name (only fields of ``model``)."""
    return {k: v for k, v in vars(args).items() if k in model.model_fields}


def config_from_args(args: argparse.Namespace, model: type[M], **overrides: Any) -> M:
    """Validate the given options into ``model``; a ConfigError names each bad flag."""
    return validate_config(model, {**config_values(args, model), **overrides})


__all__ = ["add_config_arguments", "config_values", "config_from_args"]
