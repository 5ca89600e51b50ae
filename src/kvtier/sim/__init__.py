"""kvtier sim: an OpenAI-compatible server with a modelled GPU and a real offload tier."""
