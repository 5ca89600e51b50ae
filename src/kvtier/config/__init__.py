"""Typed configuration of every command: one pydantic model each, whose fields are the flags."""

from kvtier.config.bench import BenchConfig
from kvtier.config.launch import LaunchConfig
from kvtier.config.replay import ReplayConfig
from kvtier.config.sim import CacheServerConfig, SimConfig
from kvtier.config.tuning import Tuning, load_tuning

__all__ = ["BenchConfig", "Tuning", "load_tuning", "ReplayConfig", "SimConfig", "CacheServerConfig", "LaunchConfig"]
