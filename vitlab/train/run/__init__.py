"""Run assembly: what every run gets by default (loggers, callbacks, plugins), the figures it logs, EMA
and throughput, the image-size schedule and host-sync counting. Uses `objectives` and `reliability`."""
