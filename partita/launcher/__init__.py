"""The ``partita`` command: ``partita run`` (a torchrun front end) and ``partita env``."""
