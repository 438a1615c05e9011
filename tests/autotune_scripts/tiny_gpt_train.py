"""A plain partita training loop on a very small GPT, for ``partita tune`` tests.

    python tiny_gpt_train.py CONFIG [--crash-at STAGE:MB] [--batch-flag N]

It trains for many steps; a ``partita tune`` trial stops it after its own step count. The
micro-batch comes from the engine (as a tuned script's must). ``--crash-at`` makes the trial
with that ZeRO stage and micro-batch raise, so the test can check a crash is recorded and
skipped; it raises before the engine starts, reading the stage and micro-batch from the
trial's config (the file ``initialize`` would read), so the crashing trial costs no engine
start-up. ``--batch-flag`` (what ``autotuning.arg_mappings`` passes) must equal the engine's
micro-batch.
"""

from __future__ import annotations

import argparse
import json

import torch

import partita
from partita.autotune.trial_env import apply_config_override
from partita.models import GPT, GPTConfig

parser = argparse.ArgumentParser()
parser.add_argument("config")
parser.add_argument("--crash-at", default=None)
parser.add_argument("--batch-flag", type=int, default=None)
args = parser.parse_args()

trial = apply_config_override(args.config)  # partita tune's trial config, else the script's own
if not isinstance(trial, dict):
    with open(trial) as f:
        trial = json.load(f)
here = f"{trial.get('zero_optimization', {}).get('stage', 0)}:{trial['train_micro_batch_size_per_gpu']}"
if here == args.crash_at:
    raise RuntimeError(f"deliberate crash at stage:micro-batch {here}")
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
engine, _, _, _ = partita.initialize(model=model, config=args.config)
mb = engine.train_micro_batch_size_per_gpu()
if args.batch_flag is not None and args.batch_flag != mb:
    raise SystemExit(f"--batch-flag {args.batch_flag} != the engine's micro-batch {mb}")
generator = torch.Generator().manual_seed(engine.topology.rank)
for step in range(1000):
    for _ in range(engine.gradient_accumulation_steps()):
        tokens = torch.randint(0, 64, (mb, 17), generator=generator)
        _, loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
