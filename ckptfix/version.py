"""The package version, in a module of its own: the record writers read it without importing the package's
public verbs (and so everything they import)."""

__version__ = "0.1.0"
