"""The evaluation harness: workloads, validation, statistics, verdicts and reports.

Nothing in this package imports torch: it must run from a light install and measure a remote server. The in-process
engine backend is imported lazily, only when a run asks for it.
"""
