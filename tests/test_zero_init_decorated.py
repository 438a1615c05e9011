"""partita.zero.Init and classes whose ``__init__`` is replaced while a context is open.

A model class imported for the first time inside ``zero.Init`` is wrapped by the context's
``__init_subclass__`` hook while ``class ...:`` runs, and a class decorator applied right after
(transformers' ``use_kernelized_func``, from the ``kernels`` package, wraps ``LlamaAttention``)
then wraps the context's wrapper. The context's exit must not put the pre-decorator ``__init__``
back over the decorator's: the second model built used to lose ``_kernel_funcs`` and fail its
first forward with AttributeError. A forked rank (tests/harness.py) imports transformers'
Llama lazily, inside the first context, which is how the bug showed.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from tests.harness import run_distributed

_CONFIG = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}


def _tag_init(cls):
    """A class decorator in the style of ``use_kernelized_func``: wraps ``cls.__init__``
    (with ``functools.wraps``, which copies the wrapped function's attributes, markers included)."""
    inner = cls.__init__

    @functools.wraps(inner)
    def tagged(self, *args, **kwargs):
        inner(self, *args, **kwargs)
        self.__dict__["tag"] = "set by the decorator"

    cls.__init__ = tagged
    return cls


def _two_llamas_each_under_init() -> list[list[bool]]:
    import sys

    from partita.distributed.init import init_distributed
    from partita.zero import Init
    from tests.test_peft_lora import _llama

    init_distributed()
    # Precondition of the bug: Llama's modeling module is first imported inside the context.
    assert "transformers.models.llama.modeling_llama" not in sys.modules
    found = []
    for _ in range(2):
        with Init(config_dict_or_path=dict(_CONFIG)):
            model = _llama()
        found.append([
            "_kernel_funcs" in m.__dict__ for m in model.modules() if type(m).__name__ == "LlamaAttention"
        ])
    return found


def test_kernel_decorated_llama_attention_keeps_its_init_across_contexts() -> None:
    per_rank = run_distributed(_two_llamas_each_under_init, 2)
    for rank, found in enumerate(per_rank):
        assert found == [[True, True], [True, True]], (rank, found)


def _class_decorated_inside_the_context() -> dict:
    from partita.distributed.init import init_distributed
    from partita.zero import Init
    from partita.zero.init_context import init_shard_of

    init_distributed()
    with Init(config_dict_or_path=dict(_CONFIG)):

        @_tag_init
        class Tagged(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.weight = nn.Parameter(torch.ones(6))

        inside = Tagged()
    after = Tagged()  # outside any context: whole parameters, the decorator still runs
    with Init(config_dict_or_path=dict(_CONFIG)):
        again = Tagged()  # a second context shards it again
    return {
        "tags": [m.__dict__.get("tag") for m in (inside, after, again)],
        "sharded": [init_shard_of(m.weight) is not None for m in (inside, after, again)],
        "after_whole": after.weight.untyped_storage().nbytes() == 6 * 4,
    }


def test_init_decorated_inside_the_context_survives_its_exit() -> None:
    for rank, got in enumerate(run_distributed(_class_decorated_inside_the_context, 2)):
        assert got["tags"] == ["set by the decorator"] * 3, (rank, got)
        assert got["sharded"] == [True, False, True], (rank, got)
        assert got["after_whole"], (rank, got)
