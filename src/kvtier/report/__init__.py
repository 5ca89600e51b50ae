"""Result files: the self-describing result dict and its writers (JSON, XLSX)."""
