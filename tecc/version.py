"""The version of tecc, in one place: `tecc.__version__`, and what the compile cache and the
tuning database record when tecc runs from a source tree that was never installed."""

__version__ = "0.1.0"
