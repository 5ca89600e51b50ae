"""The ``kvtier`` command."""
