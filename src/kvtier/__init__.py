"""kvtier: where should the KV cache live, and what does each choice cost?"""

__version__ = "0.1.0"
