"""The on-disk checkpoint format: directory layout, file names and tensor keys.

[Note: checkpoint format, version 2]

    save_dir/
      latest                      the newest complete tag (text; replaced atomically)
      <tag>.partial/              a save in progress (renamed to <tag> once every rank is done)
      <tag>/
        manifest.json             written last: every other file's size and sha256, summary
        meta.json                 rank 0: counters, config, parameter table, optimizer groups
                                  (hyperparameters, scalar state), loss scaler, LR scheduler,
                                  sampler position, client_state (JSON; tensors by reference)
        model.safetensors         rank 0: the module's state_dict in its own dtype; tied
                                  parameters stored once (meta.json lists the aliases)
        state.safetensors         rank 0: the tensors meta.json refers to (optimizer scalars such
                                  as Adam's step, client_state tensors, scheduler tensors)
        rank00000.safetensors     one per rank: that rank's random generator states and its
        rank00001.safetensors     shards of the fp32 master weights and optimizer states

Shards are stored per parameter, flattened, as the element range ``[start, end)`` of the
full parameter that the rank owned: keys ``master/<param name>`` and ``state/<key>/<param
name>`` (``state/exp_avg/fc1.weight``). meta.json's parameter table records, for every
trainable parameter, its group, full shape and the list of ``{file, start, end}`` shards.
A load on any world size and ZeRO stage reads, for each range it owns now, the overlapping
parts of the saved shards: no conversion step, and a rank reads only what it needs.
Block-wise (8-bit) optimizer state is cut the same way (meta.json's group records its
``block_size``): codes ``state/state1/<name>`` per element, over the shard's range rounded up
to whole blocks; scales ``state/absmax1/<name>`` per block, over blocks ``[start/B,
ceil(end/B))``; and ``master_padding/<name>``, the master weights of the padding in a
parameter's last block (:mod:`partita.checkpoint.state_layout` says why this is exact).
Frozen parameters ZeRO-3 holds as shards (built under ``zero.Init``; they have no master) are
stored the same way in the model's dtype, keys ``frozen/<param name>``, with their shards listed
in meta.json's ``model.frozen_shards`` (:mod:`partita.checkpoint.frozen`).
At stage 0 every rank holds the whole state, so only rank 0 writes shards (one range per
parameter covering it all). ZeRO-3 uses the same table; its model file may then omit the
sharded parameters, which are rebuilt from the fp32 master shards.

Version 2 adds tensor parallelism (version 1 checkpoints load unchanged: they are version 2
checkpoints without it). meta.json records ``tensor_parallel_size``; a tensor-sharded
parameter's entry holds its whole shape, its split (``tensor``: dim, size, chunks) and one
``pieces`` entry per tensor rank with that rank's ``{file, start, end}`` shards of its local
tensor (:mod:`partita.checkpoint.tensor_layout` has the details and the load rules). Such
parameters are not in the model file (like ZeRO-3's sharded ones); replicated ones are written
by tensor rank 0 only. Rank files stay one per global rank.

Pipeline checkpoints (partita/pipe/checkpoint.py) are version 2 checkpoints too: keys are the
PipelineModule's state_dict names, which carry a layer's global index (``3.linear.weight``)
or its tie key (``tied_modules.embed.weight``), so they do not depend on the stage count. Each
stage's first rank writes its stage's model file (``model-stage00001.safetensors``;
``model.files`` in meta.json maps every stored key to its file); a tied layer is stored once,
by its first owner stage. meta.json's parameter table and groups cover every stage (a stage's
groups are numbered after the previous stages'), and its ``pipeline`` section records the
layer list (layer count, stage boundaries, tie positions) for ``consolidate``.
"""

from __future__ import annotations

import re

FORMAT_NAME = "partita-checkpoint"
FORMAT_VERSION = 2


def meta_header(tag: str) -> dict:
    """The first keys of every meta.json: format, version, tag and the versions that wrote it."""
    import torch

    from partita.version import __version__

    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "tag": tag,
            "partita_version": __version__, "torch_version": torch.__version__}

LATEST_FILE = "latest"
MANIFEST_FILE = "manifest.json"
META_FILE = "meta.json"
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.safetensors"
PARTIAL_SUFFIX = ".partial"
RNG_METADATA_KEY = "partita_rng"


def stage_model_file(stage: int) -> str:
    """A pipeline checkpoint's model file of one stage (see partita/pipe/checkpoint.py)."""
    return f"model-stage{stage:05d}.safetensors"


def model_file_of(model_meta: dict, key: str) -> str:
    """The model file holding ``key``: one file, or (a pipeline checkpoint: ``model.files``) one per stage."""
    return model_meta.get("files", {}).get(key, model_meta["file"])


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def master_key(param_name: str) -> str:
    return f"master/{param_name}"


def frozen_key(param_name: str) -> str:
    """A ZeRO-3 sharded frozen parameter's range, in its own dtype (partita/checkpoint/frozen.py)."""
    return f"frozen/{param_name}"


def state_key(state_name: str, param_name: str) -> str:
    return f"state/{state_name}/{param_name}"


def master_padding_key(param_name: str) -> str:
    """The master weights of the padding elements in a parameter's last block (block-wise state)."""
    return f"master_padding/{param_name}"


def local_state_key(group: int, state_name: str) -> str:
    """Optimizer state of a kind partita cannot cut per parameter: saved per rank, same-layout loads only."""
    return f"local/group{group}/{state_name}"


_BAD_TAG = re.compile(r"[/\\\x00]")


def check_tag(tag: str) -> str | None:
    """Why ``tag`` cannot name a checkpoint directory, or None when it can."""
    if not isinstance(tag, str) or not tag:
        return f"the tag must be a non-empty string, got {tag!r}"
    if _BAD_TAG.search(tag) or tag in (".", ".."):
        return f"the tag {tag!r} must be a plain directory name (no '/', '\\' or NUL, not '.' or '..')"
    if tag == LATEST_FILE or tag.startswith(".") or tag.endswith(PARTIAL_SUFFIX):
        return f"the tag {tag!r} is reserved (not 'latest', not starting with '.', not ending in '{PARTIAL_SUFFIX}')"
    return None
