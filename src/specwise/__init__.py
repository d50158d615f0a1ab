"""specwise: serve speculative decoding and measure, per workload, whether it pays off."""

__version__ = "0.1.0"
