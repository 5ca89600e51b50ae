"""The storage benchmark: simulated users driving the tiered store."""
