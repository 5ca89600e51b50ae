"""``kvtier plan`` (placement economics): filled in by the planner issue."""

from __future__ import annotations

import argparse


def add_plan_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    return None
