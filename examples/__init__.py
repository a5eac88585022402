"""Runnable examples of embedding aiolayer in an engine; not part of the installed packages."""
