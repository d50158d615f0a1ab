"""`specwise serve`: the OpenAI-compatible server (app), its wire format (protocol), Prometheus metrics (metrics) and
the command that checks the flags and starts it all (command)."""
