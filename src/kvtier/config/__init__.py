"""Typed configuration of every command: one pydantic model each, whose fields are the flags."""

from kvtier.config.bench import BenchConfig, Tuning, load_tuning
from kvtier.config.launch import LaunchConfig
from kvtier.config.replay import ReplayConfig
from kvtier.config.sim import CacheServerConfig, SimConfig

__all__ = ["BenchConfig", "Tuning", "load_tuning", "ReplayConfig", "SimConfig", "CacheServerConfig", "LaunchConfig"]
