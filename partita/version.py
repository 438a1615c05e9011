"""partita's version, in a module of its own so that any layer can read it (a checkpoint's
meta.json records it) without importing the package root, which sits above every layer."""

__version__ = "0.1.0"
