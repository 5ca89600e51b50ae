"""kvtier replay: recorded multi-turn conversations as closed-loop virtual users against a server."""
