"""Data for examples and tests: an offline byte corpus, token windows and a resumable sampler."""

from partita.data.corpus import build_stdlib_corpus, default_cache_dir, load_corpus, split_train_val
from partita.data.dataset import TokenWindowDataset
from partita.data.repeating import RepeatingLoader
from partita.data.sampler import ResumableDistributedSampler, infinite_batches

__all__ = [
    "RepeatingLoader",
    "ResumableDistributedSampler",
    "TokenWindowDataset",
    "build_stdlib_corpus",
    "default_cache_dir",
    "infinite_batches",
    "load_corpus",
    "split_train_val",
]
