"""aiolayer's release version, in a module of its own: the runtime reports it to peers without importing the package."""

__version__ = "0.1.0"
