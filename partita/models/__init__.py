"""Reference models used by partita's examples, tests and benchmarks."""

from partita.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
