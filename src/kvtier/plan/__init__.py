"""Placement economics: KV bytes per token, fetch vs recompute, the fetch gate, capacity."""
