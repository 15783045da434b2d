"""The package's version, on the ground floor so that the engine's fingerprint can read it."""

__version__ = "0.1.0"  # pyproject.toml's `version`
