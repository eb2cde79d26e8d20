"""The package version, in one place (read by the package, the store and the operating point)."""

__version__ = "0.1.0"
