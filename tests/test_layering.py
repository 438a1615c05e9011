"""partita's layers, bottom to top, and the rule that imports point down (or sideways, within a layer).

No cycles (tests/test_import_cycles.py) is not enough for a package one can read from the top:
``zero/`` importing the engine is no cycle while the engine does not import that module back,
but it means the lower layer knows the one built on it. Here every module has a layer, and an
import from a module to one in a higher layer is an *upward import*; the test fails on any upward
import not in ``ALLOWED`` (each there with its reason), and on an ``ALLOWED`` entry that no longer
exists (so the list only shrinks). The import walk is test_import_cycles.py's (module-level and
in-function imports count, ``TYPE_CHECKING`` ones do not).

The layers (``LAYERS``), each built on the ones before it:

- ``base``: helpers with no partita dependencies worth the name (logging, tensor walks, the
  progress bar, the DeepSpeed-refusal error type).
- ``config``: the config loader and every feature's own config section (``partita.<pkg>.config``
  and its siblings in ``SECTION_MODULES``): ``partita.config`` assembles them, so they sit with it.
- ``distributed``: process groups, the topology, collectives and what records them.
- ``model``: what a model is made of and turned into before training: the reference models,
  tensor/sequence/expert parallel layers, activation checkpointing, compile, precision, data,
  the pipeline's layer list (``PipelineModule``).
- ``states``: the training states and their homes: ZeRO, offload, the optimizers and the memory
  estimator that plans them (they interleave: ZeRO picks its fold and offload from the estimator).
- ``observe``: monitoring, the step log and checkpoints, which read every state below.
- ``engine``: the engine, the pipeline engine and inference engines, which drive everything below.
- ``entry``: what users call: ``initialize`` (bootstrap), the package root, autotuning, the
  launcher and the Hugging Face integrations, and the DeepSpeed-named shims (``runtime``,
  ``comm``, ``accelerator``, ``ops``, ``checkpointing``), which forward to the layers below.

When this fails on an import you just wrote: import the piece from a lower module, move the
piece down (an interface or constant the lower layer owns), put a type-only import under
``if TYPE_CHECKING:``, or move the function to the layer that owns its data. Allow-listing is for
what cannot be fixed cheaply, with the reason written next to it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import partita
from tests.test_import_cycles import import_graph

# Bottom to top; a package (partita.<name>) belongs to the layer listing its name ("" is the root).
LAYERS: list[tuple[str, list[str]]] = [
    ("base", ["utils", "tensor_containers", "progress", "deepspeed_compat", "version"]),
    ("config", ["config"]),
    ("distributed", ["distributed", "sample_count"]),
    ("model", ["models", "tensor_parallel", "sequence", "moe", "activation_checkpointing", "compile", "precision",
               "data", "param_groups", "schedules"]),
    ("states", ["zero", "offload", "optim", "estimate"]),
    ("observe", ["monitor", "step_log", "checkpoint"]),
    ("engine", ["engine", "pipe", "inference"]),
    ("entry", ["", "bootstrap", "autotune", "integrations", "launcher", "runtime", "comm", "accelerator", "ops",
               "checkpointing"]),
]

# A feature's config section lives in its package but belongs to the config layer (partita.config
# imports it to build the root model). Module names, under any package but the DeepSpeed shims'.
SECTION_MODULES = ("config", "fp8_config", "generation_config", "tier_config")
SHIMS = ("partita.runtime", "partita.comm", "partita.accelerator", "partita.checkpointing")

# Modules whose layer is not their package's, each with why.
MODULE_LAYERS: dict[str, tuple[str, str]] = {
    "partita.utils": ("entry", "the package itself is DeepSpeed's deepspeed.utils path (a shim: logger, log_dist, "
                               "set_z3_leaf_modules); its modules (utils.logging, ...) are base"),
    "partita.monitor.comms_logger": (
        "distributed", "records every collective partita issues; it imports only torch and the collectives call it"),
    "partita.pipe.module": ("model", "PipelineModule is the layer list a pipelined model is written as"),
    "partita.pipe.partition": ("model", "how PipelineModule cuts its layers into stages (pure arithmetic)"),
    "partita.pipe.topology": ("model", "the stage/data/tensor sizes PipelineModule checks (pure arithmetic)"),
    "partita.pipe.failure": (
        "distributed", "a stage's failure raised on every stage: an agreement over the collectives, which it "
        "alone imports (PipelineModule adds its notes to a layer's exception)"),
    "partita.zero.inference_engine": ("engine", "the ZeRO-Inference engine: an Engine subclass"),
}

# The upward imports that stay, importer -> imported, each with why it is not cheap to fix.
ALLOWED: dict[tuple[str, str], str] = {
    ("partita.config.batch", "partita.checkpoint.format"):
        "comparing the batch sizes with a checkpoint's saved config reads its meta.json (in-function); "
        "the function belongs in checkpoint/, which its callers would then import",
    ("partita.config.batch", "partita.checkpoint.jsoncodec"): "as above: decoding the saved config",
    ("partita.ops.sparse_attention.config", "partita.ops.sparse_attention.sparsity_config"):
        "the sparse_attention section builds DeepSpeed's pattern classes from its keys",
    ("partita.compile.apply", "partita.zero.units"):
        "a compiled region must not contain a ZeRO-3 unit (its gather hooks would run inside the compiled code)",
    ("partita.moe.registry", "partita.zero.shard_group"):
        "expert parameters are ZeRO-sharded within their expert-data group: the registry builds ZeRO's ShardComm",
    ("partita.precision.fp8", "partita.zero.fp8_gather"):
        "fp8.all_gather marks the converted weights for ZeRO-3's FP8 gather (in-function)",
    ("partita.tensor_parallel.setup", "partita.zero.init_context"):
        "refusing a model built under zero.Init needs ZeRO's marker of its shards (in-function)",
    ("partita.step_log", "partita.autotune.trial_env"):
        "each print step is reported to an autotuning trial; TrialReporter only reads the environment and "
        "writes a file, but it lives with the tuner",
}


def _rank() -> dict[str, int]:
    return {package: i for i, (_, packages) in enumerate(LAYERS) for package in packages}


def layer_of(module: str) -> int:
    """The index in LAYERS of ``module``'s layer."""
    names = [name for name, _ in LAYERS]
    if module in MODULE_LAYERS:
        return names.index(MODULE_LAYERS[module][0])
    parts = module.split(".")
    if len(parts) >= 3 and parts[-1] in SECTION_MODULES and not module.startswith(SHIMS):
        return names.index("config")
    package = parts[1] if len(parts) > 1 else ""
    rank = _rank()
    if package not in rank:
        raise AssertionError(f"partita.{package} has no layer: add it to tests/test_layering.py's LAYERS")
    return rank[package]


def upward_imports(graph: dict[str, dict[str, list[int]]]) -> dict[tuple[str, str], list[int]]:
    """Every import from a module to one in a higher layer -> the importing lines."""
    return {(source, target): lines for source in sorted(graph) for target, lines in sorted(graph[source].items())
            if layer_of(target) > layer_of(source)}


def _describe(edge: tuple[str, str], lines: list[int]) -> str:
    names = [name for name, _ in LAYERS]
    source, target = edge
    return (f"  {source} ({names[layer_of(source)]}) -> {target} ({names[layer_of(target)]}), "
            f"line {', '.join(map(str, lines))}")


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, list[int]]]:
    return import_graph(Path(partita.__file__).parent, "partita")


def test_every_module_has_a_layer(graph) -> None:
    assert len(graph) > 100
    for module in graph:
        layer_of(module)  # raises naming a package that LAYERS does not place
    assert set(MODULE_LAYERS) <= set(graph), sorted(set(MODULE_LAYERS) - set(graph))


def test_no_new_upward_imports(graph) -> None:
    found = upward_imports(graph)
    new = {edge: lines for edge, lines in found.items() if edge not in ALLOWED}
    assert not new, ("these imports point from a lower layer up (see tests/test_layering.py for the layers and "
                     "the fixes):\n" + "\n".join(_describe(edge, lines) for edge, lines in new.items()))
    gone = sorted(set(ALLOWED) - set(found))
    assert not gone, f"allowed upward imports that no longer exist, remove them from ALLOWED: {gone}"


def test_an_upward_import_is_found_and_type_checking_ones_are_not(tmp_path: Path, monkeypatch) -> None:
    files = {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "",
        "pkg/low/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high.b import B\n"
                        "def f():\n    from pkg.high import b\n",
        "pkg/low/config.py": "from pkg.high.b import B\n",  # a section module: the config layer, also below
        "pkg/high/__init__.py": "",
        "pkg/high/b.py": "from pkg.low.a import f\nclass B: ...\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    this = sys.modules[__name__]
    monkeypatch.setattr(this, "LAYERS", [("config", []), ("low", ["low"]), ("high", ["high", ""])])
    monkeypatch.setattr(this, "MODULE_LAYERS", {})
    monkeypatch.setattr(this, "SHIMS", ("pkg.none",))
    found = upward_imports(import_graph(tmp_path / "pkg", "pkg"))
    # the in-function import counts, the TYPE_CHECKING one does not; high -> low is downward
    assert found == {("pkg.low.a", "pkg.high"): [5], ("pkg.low.a", "pkg.high.b"): [5],
                     ("pkg.low.config", "pkg.high.b"): [1]}
