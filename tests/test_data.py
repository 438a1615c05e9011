"""Corpus, token windows, the resumable sampler and the progress display (partita.data, partita.progress)."""

from __future__ import annotations

import hashlib
import io
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from partita.data import (
    ResumableDistributedSampler,
    TokenWindowDataset,
    build_stdlib_corpus,
    infinite_batches,
    load_corpus,
    split_train_val,
)
from partita.data import corpus as corpus_module
from partita.data.corpus import stdlib_root, stdlib_source_files
from partita.progress import Progress, progress

# ------------------------------------------------------------------ corpus


def test_corpus_is_deterministic_and_named_by_its_content(tmp_path):
    a = build_stdlib_corpus(cache_dir=tmp_path / "a")
    b = build_stdlib_corpus(cache_dir=tmp_path / "b")
    data = a.read_bytes()
    assert data == b.read_bytes()
    assert a.name == b.name == f"stdlib-{hashlib.sha256(data).hexdigest()[:16]}.u8"
    # Sorted files, each behind a header line; the first file opens the corpus.
    files = stdlib_source_files()
    assert files == sorted(files) and len(files) > 100
    assert data.startswith(f"# ---- {files[0]}\n".encode() + (stdlib_root() / files[0]).read_bytes())
    assert not any(part in {"site-packages", "test", "tests", "idle_test"} for f in files for part in f.split("/"))
    # Built once: a second call finds the file and does not rewrite it.
    mtime = a.stat().st_mtime_ns
    assert build_stdlib_corpus(cache_dir=tmp_path / "a") == a and a.stat().st_mtime_ns == mtime


def test_load_corpus_is_a_uint8_memmap_and_max_bytes_truncates(tmp_path):
    tokens = load_corpus(cache_dir=tmp_path, max_bytes=5000)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint8 and len(tokens) == 5000
    full = build_stdlib_corpus(cache_dir=tmp_path).read_bytes()
    assert bytes(tokens) == full[:5000]


def test_cache_dir_defaults_to_partita_cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("PARTITA_CACHE", str(tmp_path / "env"))
    path = build_stdlib_corpus(max_bytes=1000)
    assert path.parent == tmp_path / "env"


_BUILD_WHEN_BOTH_READY = """
import importlib.util, pathlib, sys, time
# corpus.py alone (numpy only): importing the partita package would load torch, slowly.
spec = importlib.util.spec_from_file_location("corpus", sys.argv[4])
corpus = importlib.util.module_from_spec(spec)
spec.loader.exec_module(corpus)
cache, barrier, me = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3]
(barrier / me).touch()
while len(list(barrier.iterdir())) < 2:  # both interpreters are up: build at the same instant
    time.sleep(0.001)
print(corpus.build_stdlib_corpus(cache_dir=cache))
"""


def test_two_processes_building_at_once_give_one_valid_file(tmp_path):
    cache, barrier = tmp_path / "cache", tmp_path / "barrier"
    barrier.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BUILD_WHEN_BOTH_READY, str(cache), str(barrier), str(rank), corpus_module.__file__],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    paths = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert paths[0] == paths[1]
    expected = build_stdlib_corpus(cache_dir=tmp_path / "reference").read_bytes()
    assert pathlib.Path(paths[0]).read_bytes() == expected
    assert sorted(os.listdir(cache)) == [pathlib.Path(paths[0]).name]  # no temporary file left behind


def test_split_train_val_takes_the_last_five_percent():
    tokens = np.arange(1000, dtype=np.uint8)
    train, val = split_train_val(tokens)
    assert len(train) == 950 and len(val) == 50
    assert np.array_equal(np.concatenate([train, val]), tokens)
    with pytest.raises(ValueError, match="val_fraction must be in"):
        split_train_val(tokens, val_fraction=1.0)
    with pytest.raises(ValueError, match="one side would be empty"):
        split_train_val(np.arange(10), val_fraction=0.05)


# ------------------------------------------------------------------ dataset


def test_token_windows_are_exact_and_shifted_by_one():
    tokens = np.arange(23, dtype=np.uint8)
    ds = TokenWindowDataset(tokens, 5)
    assert len(ds) == 4  # windows need 6 tokens: starts 0, 5, 10, 15 (20 would need index 25)
    x, y = ds[2]
    assert x.dtype == y.dtype == torch.int64
    assert x.tolist() == [10, 11, 12, 13, 14] and y.tolist() == [11, 12, 13, 14, 15]
    assert ds[-1][0].tolist() == [15, 16, 17, 18, 19]
    with pytest.raises(IndexError):
        ds[4]


def test_token_windows_with_stride_and_torch_tensor_input():
    ds = TokenWindowDataset(torch.arange(12, dtype=torch.uint8), 4, stride=3)
    assert len(ds) == 3  # starts 0, 3, 6 (9 would need index 13)
    x, y = ds[1]
    assert x.tolist() == [3, 4, 5, 6] and y.tolist() == [4, 5, 6, 7] and x.dtype == torch.int64


def test_token_windows_refuse_too_little_data():
    with pytest.raises(ValueError, match="cannot fill one window of block_size=8"):
        TokenWindowDataset(np.zeros(8, dtype=np.uint8), 8)


# ------------------------------------------------------------------ sampler


def _samplers(n: int, world: int, **kwargs) -> list[ResumableDistributedSampler]:
    return [ResumableDistributedSampler(range(n), num_replicas=world, rank=r, **kwargs) for r in range(world)]


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("shuffle", [True, False])
def test_uninterrupted_epoch_matches_torch_distributed_sampler(drop_last, shuffle):
    for rank in range(3):
        ours = ResumableDistributedSampler(range(20), num_replicas=3, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last)
        theirs = DistributedSampler(range(20), num_replicas=3, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last)
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)


def test_ranks_are_disjoint_and_cover_the_epoch():
    parts = [list(s) for s in _samplers(23, 4, seed=3)]
    assert all(len(p) == 5 for p in parts)  # 23 // 4, tail of 3 dropped
    flat = [i for p in parts for i in p]
    assert len(set(flat)) == 20 and set(flat) <= set(range(23))
    padded = [list(s) for s in _samplers(23, 4, seed=3, drop_last=False)]
    assert set(i for p in padded for i in p) == set(range(23)) and all(len(p) == 6 for p in padded)


def test_same_permutation_on_every_rank():
    world = 4
    parts = [list(s) for s in _samplers(40, world, seed=11)]
    interleaved = [parts[p % world][p // world] for p in range(40)]  # position p went to rank p % world
    generator = torch.Generator().manual_seed(11)
    assert interleaved == torch.randperm(40, generator=generator).tolist()


def test_epochs_advance_by_themselves_and_differ_when_shuffling():
    sampler = ResumableDistributedSampler(range(50), num_replicas=2, rank=0, seed=0)
    first, second = list(sampler), list(sampler)
    assert sampler.epoch == 2
    assert first != second and len(first) == len(second) == 25
    unshuffled = ResumableDistributedSampler(range(50), num_replicas=2, rank=0, shuffle=False)
    assert list(unshuffled) == list(unshuffled) == list(range(0, 50, 2))


def test_resume_mid_epoch_yields_exactly_the_remaining_indices():
    full = [list(s) for s in _samplers(30, 3, seed=5)]
    saved = []
    for sampler in _samplers(30, 3, seed=5):
        it = iter(sampler)
        head = [next(it) for _ in range(4)]
        assert head == full[sampler.rank][:4]
        saved.append(sampler.state_dict())
    assert saved[0] == {
        "epoch": 0, "consumed": 12, "num_replicas": 3, "seed": 5, "shuffle": True, "drop_last": True, "dataset_len": 30,
    }  # fmt: skip
    for rank, state in enumerate(saved):
        resumed = ResumableDistributedSampler(range(30), num_replicas=3, rank=rank, seed=5)
        resumed.load_state_dict(state)
        resumed.set_epoch(0)  # the usual loop calls set_epoch with the restored epoch: keeps the position
        assert len(resumed) == 6
        assert list(resumed) == full[rank][4:]
        assert resumed.epoch == 1 and resumed.state_dict()["consumed"] == 0


def test_resume_on_a_different_world_size_continues_the_same_order():
    order = torch.randperm(40, generator=torch.Generator().manual_seed(0)).tolist()
    before = _samplers(40, 4)
    for sampler in before:
        it = iter(sampler)
        [next(it) for _ in range(3)]  # 12 positions consumed in total
    state = before[0].state_dict()
    after = _samplers(40, 2)
    for sampler in after:
        sampler.load_state_dict(state)
    rest = [list(s) for s in after]
    assert sorted(rest[0] + rest[1]) == sorted(order[12:])
    assert rest[0] == order[12::2] and rest[1] == order[13::2]


def test_load_state_dict_refuses_another_order():
    state = _samplers(30, 2, seed=1)[0].state_dict()
    with pytest.raises(ValueError, match="seed: saved 1, now 2"):
        _samplers(30, 2, seed=2)[0].load_state_dict(state)
    with pytest.raises(ValueError, match="dataset_len: saved 30, now 31"):
        _samplers(31, 2, seed=1)[0].load_state_dict(state)


def test_set_epoch_to_a_new_epoch_restarts_its_position():
    sampler = ResumableDistributedSampler(range(10), num_replicas=1, rank=0, seed=0)
    it = iter(sampler)
    next(it), next(it)
    sampler.set_epoch(3)
    assert sampler.state_dict()["consumed"] == 0
    assert list(sampler) == torch.randperm(10, generator=torch.Generator().manual_seed(3)).tolist()


def test_sampler_refuses_bad_rank():
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        ResumableDistributedSampler(range(4), num_replicas=2, rank=2)


def test_dataloader_resume_through_state_dict_and_infinite_batches():
    dataset = TokenWindowDataset(np.arange(81, dtype=np.uint8), 4)  # 20 windows
    def loader_for(sampler):
        return DataLoader(dataset, batch_size=3, sampler=sampler, drop_last=True)
    sampler = ResumableDistributedSampler(dataset, num_replicas=2, rank=1, seed=9)
    stream = infinite_batches(loader_for(sampler))
    seen = [next(stream)[0][:, 0].tolist() for _ in range(4)]  # 3 batches per epoch: crosses into epoch 1
    assert sampler.epoch == 1
    state = sampler.state_dict()
    assert state["epoch"] == 1 and state["consumed"] == 6  # one batch of 3 on each of 2 ranks
    uninterrupted = infinite_batches(loader_for(ResumableDistributedSampler(dataset, num_replicas=2, rank=1, seed=9)))
    expected = [next(uninterrupted)[0][:, 0].tolist() for _ in range(8)]
    resumed_sampler = ResumableDistributedSampler(dataset, num_replicas=2, rank=1, seed=9)
    resumed_sampler.load_state_dict(state)
    resumed = infinite_batches(loader_for(resumed_sampler))
    assert seen + [next(resumed)[0][:, 0].tolist() for _ in range(4)] == expected


def test_infinite_batches_reshuffles_with_torch_sampler_and_refuses_empty_loaders():
    sampler = DistributedSampler(range(6), num_replicas=1, rank=0, seed=0)
    stream = infinite_batches(DataLoader(range(6), batch_size=6, sampler=sampler))
    first, second = next(stream).tolist(), next(stream).tolist()
    assert sorted(first) == sorted(second) == list(range(6)) and first != second
    with pytest.raises(ValueError, match="yielded no batch"):
        next(infinite_batches(DataLoader(range(2), batch_size=4, drop_last=True)))


# ------------------------------------------------------------------ progress


def test_progress_prints_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    bar = Progress(total=4, desc="train", enabled=True, interval_s=0.0, file=out)
    bar.update(1, loss=2.5)
    bar.update(3)
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("train: 1/4 (25%), eta ") and lines[0].endswith("loss=2.5")
    assert lines[-1].startswith("train: 4/4 (100%) [") and lines[-1].endswith("loss=2.5")


def test_progress_disabled_prints_nothing_and_wraps_iterables(capsys):
    assert list(progress(range(3), desc="x", enabled=False)) == [0, 1, 2]
    quiet = progress(5, desc="x", enabled=False)
    quiet.update(5)
    quiet.close()
    assert capsys.readouterr().out == "" and quiet.n == 5
