"""Typed configuration: the bench flags, the reference config.yaml layout, validation."""

from kvtier.config.bench import BenchConfig, Tuning, load_tuning

__all__ = ["BenchConfig", "Tuning", "load_tuning"]
