"""Presentation of results: ``kvtier report`` (one HTML page, html.py), its plots (plots.py) and named
figures with their sentences (figures.py), and ``kvtier compare`` (compare.py).

Everything here reads the typed models of ``kvtier.results`` (``kvtier.results.load``); the models, their
status rule and the writers (JSON, XLSX) live there, a floor below, so every command can import them
without this one.
"""
