"""Monitoring a deployment against the evaluation that justified it: the request log (`requestlog`), the drift
comparison behind `specwise monitor` (`drift`) and the server's live drift gauges (`live`). No torch here: the
server hands finished requests in; nothing is imported from the engine."""
