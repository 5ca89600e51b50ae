"""``kvtier mlperf``: the MLPerf Storage v3.0 KV cache submission workflow (run.py: the three workloads,
CLOSED rules against --open, trials as MPI runs, the wrapper's table beside kvtier's figures, the verdict)."""
