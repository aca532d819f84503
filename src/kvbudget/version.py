"""The package version (``kvbudget.__version__``; profiles record it)."""

__version__ = "0.1.0"
