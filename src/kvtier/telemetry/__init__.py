"""One clock, raw samples and counters: what the runner records and the report summarises."""
