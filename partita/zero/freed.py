"""What a freed parameter is, and the one pair of functions that frees and refills it.

[Note: freed parameters]
ZeRO-3 (partita/zero/param_gatherer.py), ``partita.zero.Init`` before ``initialize``
(init_context.py) and one-process weight freeing at stages 0-2 (one_rank_weights.py) free a
parameter between uses by resizing its storage to 0 bytes *in place*: the ``nn.Parameter``
object, its TensorImpl, shape and strides never change, so the tensors autograd saved for
backward (the parameter itself and views of it, which share that storage) see the values again
once the storage is resized back and refilled. A parameter whose storage is empty but whose
shape is whole must never reach a kernel: reading it reads unallocated memory (a segfault on
CPU, an illegal address on CUDA).

So while freed, a parameter's Python class is a subclass of its own class (``Freed<Cls>``,
made once per class, e.g. ``FreedParameter``) whose ``__torch_function__`` lets through only
what reads no values, and raises :class:`ParameterNotGatheredError` for everything else:

- metadata answers as for the whole parameter: ``shape``, ``size()``, ``numel()``, ``dtype``,
  ``device``, ``requires_grad``, ``grad``, ``stride()``, ``dim()``, ``len()``, ``hash``,
  ``is_floating_point()``, ``untyped_storage()`` (0 bytes), ``data_ptr()``, hook registration,
  ``requires_grad_()``, ``*_like`` / ``new_*`` constructors;
- ``p.data`` and ``p.detach()`` give a :class:`NotGatheredPlaceholder` (the same metadata, no
  storage; any value read raises), which is also what ``state_dict()`` holds for it;
- a conversion that would be a no-op (``p.to(p.device)``, ``p.float()`` of an fp32 ``p``,
  ``p.contiguous()``) returns the parameter itself, so ``model.to(device)`` works on a sharded
  model; one that would copy raises;
- ``repr``/``print`` describe it (name, shape, dtype, why it is freed) without reading values;
- everything that reads or writes values raises: arithmetic, ``norm()``, ``sum()``, indexing,
  views, ``clone()``, ``cpu()``, ``tolist()``, ``numpy()``, comparisons, ``copy.deepcopy``,
  ``torch.save``/pickling, use in ``F.linear`` outside the model's hooks, ``p.data = x``.

Gathering restores the parameter's own class first: inside a unit's forward and backward and
inside ``GatheredParameters`` it is exactly the user's ``nn.Parameter`` (torch.compile's guards
on parameter types and shapes see what they traced; nothing in the training step runs through
this module's ``__torch_function__``).

Why not DeepSpeed's answer (``param.data`` swapped for a 0-element tensor, the real shape in
``param.ds_shape``/``ds_numel``): every ``p.shape``/``p.numel()`` would then say 0 while freed,
in partita (partition layouts, frozen shards, estimators, the flops profiler, GPT.num_params,
activation-checkpoint sizing, the host-memory check, checkpoint layouts read them from the live
parameters) and in client code (transformers 5's ``num_parameters()`` counts ``p.numel()``, and
counts 0 under DeepSpeed's ZeRO-3). Keeping the real shape needs no ``ds_*`` attribute on
``nn.Parameter``: transformers' ``get_model_param_count`` and PEFT read ``ds_numel`` only when
present (or when ``numel()`` is 0) and get the right count from ``numel()``. The class swap is
also cheaper than a ``.data`` swap (~0.1 us against ~0.3 us per parameter and transition).

What it cannot catch: C++ code handed the tensor directly, below torch's Python API
(``torch.distributed`` collectives, custom C++/CUDA extensions, code under
``torch._C.DisableTorchFunction*``). Nothing in partita does that to a freed parameter.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["NotGatheredPlaceholder", "ParameterNotGatheredError", "ZERO3", "INIT", "ONE_RANK", "allocate_param",
           "free_param", "is_freed", "name_params", "reason_of", "share_values", "storage_sized"]

# Why a parameter is freed (what the error message tells the user to do).
ZERO3 = "zero3"  # sharded by ZeRO-3 between its unit's uses
INIT = "init"  # built under partita.zero.Init, not initialized yet
ONE_RANK = "one_rank"  # one process, stages 0-2: freed between its block's forward and backward

_NAME = WeakIdKeyDictionary()  # parameter -> its name in the model, for messages (name_params)
# (a parameter class, why) -> its freed subclass: the class says why, so freeing and refilling
# touch no registry (a weak-dictionary update costs more than the class swap itself).
_FREED_CLASS: dict[tuple[type, str], type] = {}
_OPEN_INIT_CONTEXTS = [0]  # zero.Init contexts open (their dispatch mode sees whole values)

_HOW_TO_READ = (
    "To read whole weights, gather them on every rank: `with partita.zero.GatheredParameters("
    "list(engine.module.parameters())): sd = {k: v.clone() for k, v in engine.module.state_dict().items()}`; "
    "or export them: engine.save_16bit_model(dir, 'model.safetensors'), "
    "engine._zero3_consolidated_16bit_state_dict() (rank 0, the model's dtype), "
    "engine.get_fp32_state_dict() (fp32); engine.save_checkpoint(dir) saves the training state"
)
_INIT_NOTE = (
    "It was built under partita.zero.Init and holds only this rank's shard until partita.initialize "
    "(inside the zero.Init context every op sees whole values). "
)
_ONE_RANK_NOTE = (
    "a parameter whose storage partita frees between its block's forward and backward on one process "
    "(zero_optimization.one_rank_free_weights, partita/zero/one_rank_weights.py): it is whole again once "
    "engine.backward() returns and inside partita.zero.GatheredParameters; set one_rank_free_weights to false "
    "to keep it whole"
)


class ParameterNotGatheredError(RuntimeError):
    """A ZeRO-3 parameter's values were needed where this rank holds only its shard."""


# ---------------------------------------------------------------------------------- the pair
def free_param(param: nn.Parameter, why: str, *, fresh_storage: bool = False,
               husk: torch.Tensor | None = None) -> None:
    """Free ``param``'s values in place (see [Note: freed parameters]); already freed: only ``why``
    changes. ``fresh_storage``: move it to a new empty storage and leave the old one, values
    intact, to whoever shares it (a state_dict entry taken while it was whole). ``husk``: what
    :func:`share_values` returned; the parameter moves back onto it (nothing allocated) and the
    storage it shared keeps its bytes."""
    cls = type(param)
    if issubclass(cls, _Freed):
        param.__class__ = _freed_class(cls._partita_base, why)
        return
    if husk is not None:
        param.data = husk  # the same TensorImpl, as below; the shared storage is left as it is
    elif fresh_storage:
        fresh = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device=param.device)
        fresh.untyped_storage().resize_(0)
        param.data = fresh  # the same TensorImpl: autograd's saved references to it follow
    else:
        param.untyped_storage().resize_(0)  # the parameter's own storage: no .data alias to build
    try:
        param.__class__ = _freed_class(cls, why)
    except TypeError:  # a parameter class whose layout forbids it (__slots__): freed, unguarded
        pass


def allocate_param(param: nn.Parameter) -> None:
    """Give a freed ``param`` its class and its storage's bytes back, uninitialised: the caller
    fills ``param.data`` (the whole tensor on that same storage) right away.

    A parameter may be a view into a storage it shares with others (MoE experts are rows of one
    stacked storage, partita/moe/experts.py): the storage is grown to cover this view and never
    shrunk, so refilling the rows one by one leaves every row's bytes in place."""
    cls = type(param)
    if issubclass(cls, _Freed):
        param.__class__ = cls._partita_base
    storage = param.untyped_storage()
    needed = _extent_bytes(param)
    if storage.nbytes() < needed:
        storage.resize_(needed)


def share_values(param: nn.Parameter, values: torch.Tensor) -> torch.Tensor:
    """Make a freed ``param`` whole without allocating or copying: ``values`` (its shape, dtype and
    device, contiguous) become its data, their storage shared (ZeRO-3 at one rank: a frozen
    parameter's shard is its whole value, partita/zero/frozen_params.py). Returns the husk to hand
    to ``free_param(param, why, husk=...)``: a tensor of its shape on its own 0-byte storage.

    Freeing such a parameter must never resize its storage (that would empty ``values``): only
    the husk keeps that guarantee, by moving the parameter back onto its own empty storage."""
    with torch._C.DisableTorchFunctionSubclass():
        husk = param.detach()  # a new TensorImpl on the empty storage: no allocation, no bounds check
    cls = type(param)
    if issubclass(cls, _Freed):
        param.__class__ = cls._partita_base
    param.data = values  # the same TensorImpl: autograd's saved references to it follow
    return husk


def _extent_bytes(tensor: torch.Tensor) -> int:
    """Bytes of its storage that ``tensor`` reaches: its offset plus its last element."""
    if tensor.numel() == 0:
        return tensor.storage_offset() * tensor.element_size()
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return (tensor.storage_offset() + last + 1) * tensor.element_size()


def is_freed(param: torch.Tensor) -> bool:
    """The one test of "this parameter is freed now" (ZeRO-3, zero.Init or one-rank freeing)."""
    return isinstance(param, _Freed)


def reason_of(param: torch.Tensor) -> str | None:
    """Why ``param`` is freed (ZERO3, INIT, ONE_RANK), None if it is whole."""
    return type(param)._partita_why if is_freed(param) else None


@contextlib.contextmanager
def storage_sized(params: list[nn.Parameter]) -> Iterator[None]:
    """zero.Init's view ops: torch checks a view against its storage's size, so the storage gets
    its bytes (uninitialised, never read) while the view is made; the parameters stay freed."""
    for param in params:
        param.untyped_storage().resize_(param.numel() * param.element_size())
    try:
        yield
    finally:
        for param in params:
            param.untyped_storage().resize_(0)


def name_params(named: Iterable[tuple[str, nn.Parameter]], *, replace: bool = False) -> None:
    """Record each parameter's name for error messages (``replace``: over an earlier one; else
    the first name given wins, a tied parameter's first)."""
    for name, param in named:
        if replace or param not in _NAME:
            _NAME[param] = name


def init_contexts_opened(delta: int) -> None:
    """zero.Init's ``__enter__``/``__exit__``: while one is open, its parameters are whole for ops."""
    _OPEN_INIT_CONTEXTS[0] += delta


def sharded_access_active() -> bool:
    """Inside a zero.Init context, where every op on a sharded parameter sees its whole value."""
    return _OPEN_INIT_CONTEXTS[0] > 0


# ---------------------------------------------------------------------------------- the class
_RAW = torch._C._disabled_torch_function_impl
_T = torch.Tensor
_GETTERS = ("shape", "dtype", "device", "ndim", "layout", "requires_grad", "is_leaf", "grad", "grad_fn", "is_meta",
            "is_cuda", "is_cpu", "is_xpu", "is_mps", "is_sparse", "is_quantized", "is_nested", "is_mkldnn", "names",
            "itemsize", "nbytes", "_version", "retains_grad", "output_nr", "_base", "is_inference")
_METHODS = ("size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "is_signed",
            "is_contiguous", "stride", "storage_offset", "get_device", "__len__", "__dir__", "untyped_storage",
            "data_ptr", "_is_view", "is_pinned", "is_shared", "requires_grad_", "register_hook",
            "register_post_accumulate_grad_hook", "retain_grad", "new_empty", "new_empty_strided", "new_zeros",
            "new_ones", "new_full")
_CONSTRUCTORS = ("empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like",
                 "_has_compatible_shallow_copy_type")
# Read no values, answered as for the whole parameter. Names a torch lacks are skipped.
_METADATA = frozenset(
    [getattr(_T, n).__get__ for n in _GETTERS if hasattr(_T, n)]
    + [_T.grad.__set__, _T.requires_grad.__set__]
    + [getattr(_T, n) for n in _METHODS if hasattr(_T, n)]
    + [getattr(torch, n) for n in _CONSTRUCTORS if hasattr(torch, n)]
)
_PLACEHOLDER_OF = frozenset([_T.data.__get__, _T.detach])
_DATA_SET = _T.data.__set__  # compared with ==: each attribute access makes a new method-wrapper
# Conversions: the parameter itself when they would not move, cast or copy; else they read values.
_CASTS = {_T.float: torch.float32, _T.double: torch.float64, _T.half: torch.float16, _T.bfloat16: torch.bfloat16}
_CONVERSIONS = frozenset([_T.to, _T.cpu, _T.cuda, _T.contiguous, *_CASTS])
# Read the storage directly, not through an aten op zero.Init's dispatch mode would see.
_READS_BELOW_DISPATCH = frozenset([_T.tolist, _T.numpy, _T.__array__])


class _Freed:
    """Mixed into ``Freed<Cls>``: see [Note: freed parameters]. Only ever the class of a freed parameter."""

    __slots__ = ()
    _partita_base: type  # the parameter's own class, restored by allocate_param
    _partita_why: str  # ZERO3, INIT or ONE_RANK
    _partita_alias: bool  # a plain tensor sharing a parameter's storage, made inside zero.Init

    def __hash__(self) -> int:  # Tensor.__hash__'s value, without a __torch_function__ round trip
        return id(self)

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        if _in_init_context(self):  # every op sees whole values there, printing too
            whole = _whole_copy(self)
            return repr(whole if type(self)._partita_alias else nn.Parameter(whole, self.requires_grad))
        return (f"{type(self)._partita_base.__name__}({_name(self)}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}: freed, not gathered on this rank)")

    def __format__(self, spec: str) -> str:
        return format(repr(self), spec)

    def __reduce_ex__(self, protocol: int) -> Any:
        if _in_init_context(self):  # pickled as its whole value, a plain parameter (or tensor)
            if type(self)._partita_alias:
                return _whole_copy(self).__reduce_ex__(protocol)
            return torch._utils._rebuild_parameter, (_whole_copy(self), self.requires_grad, OrderedDict())
        raise freed_error(self, "pickling (torch.save, multiprocessing, all_gather_object)")

    def __deepcopy__(self, memo: dict) -> Any:
        if _in_init_context(self):
            whole = _whole_copy(self)
            memo[id(self)] = copy = whole if type(self)._partita_alias else nn.Parameter(whole, self.requires_grad)
            return copy
        raise freed_error(self, "copy.deepcopy")

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            return _RAW(func, types, args, kwargs)
        freed = [leaf for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, _Freed)]
        if all(type(p)._partita_alias and _has_bytes(p) for p in freed):
            return _RAW(func, types, args, kwargs)  # aliases of a parameter made whole for good since
        if sharded_access_active() and all(type(p)._partita_why == INIT for p in freed):
            # zero.Init's dispatch mode makes them whole for each aten op (init_context.py); reads
            # below the dispatcher (tolist, numpy) get a whole copy made by such an op.
            if func in _READS_BELOW_DISPATCH:
                args = tuple(_whole_copy(a) if isinstance(a, _Freed) else a for a in args)
            return _guard_aliases(_RAW(func, types, args, kwargs))
        param = freed[0]
        if func in _PLACEHOLDER_OF and args and args[0] is param:
            return NotGatheredPlaceholder(param, None, why=type(param)._partita_why)
        if func == _DATA_SET and len(args) == 2 and args[1] is param:
            return None  # Module._apply after a no-op conversion: param.data = param
        if func in _CONVERSIONS and args and args[0] is param and _is_noop(param, func, args[1:], kwargs):
            return param
        if func is _T.type and len(args) == 1 and not kwargs:
            return _RAW(func, types, args, kwargs)  # the type's name
        raise freed_error(param, describe(func))


class NotGatheredPlaceholder(torch.Tensor):
    """What ``state_dict()``, ``p.data`` and ``p.detach()`` give for a freed parameter.

    A tensor with the parameter's shape, dtype and device but no storage: metadata works, any
    use of values raises :class:`ParameterNotGatheredError` (partita/zero/state_dict_guard.py
    says why state_dict() holds these rather than DeepSpeed's 0-element tensors).
    """

    _key: str | None
    _param: Any  # the parameter's name for messages, when there is no state_dict key
    _why: str  # why the parameter is freed (ZERO3, INIT, ONE_RANK)

    @staticmethod
    def __new__(cls, like: torch.Tensor, key: str | None, *, built_under_init: bool = False,
                why: str | None = None) -> NotGatheredPlaceholder:
        # A wrapper subclass: torch allocates nothing for it, and every aten op on it reaches
        # __torch_dispatch__ below (no kernel ever sees a data pointer).
        with torch._C.DisableTorchFunctionSubclass():
            shape, stride, dtype, device = like.shape, like.stride(), like.dtype, like.device
        out = torch.Tensor._make_wrapper_subclass(cls, shape, strides=stride, dtype=dtype, device=device,
                                                  requires_grad=False)
        out._key = key
        out._param = _NAME.get(like) if key is None else None
        out._why = why or (INIT if built_under_init else ZERO3)
        return out

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        what = repr(self._key) if self._key is not None else f"of parameter {self._param!r}"
        return (f"NotGatheredPlaceholder({what}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}: a ZeRO-3 parameter, not gathered on this rank)")

    def __format__(self, spec: str) -> str:
        return format(repr(self), spec)

    def _error(self, what: str) -> ParameterNotGatheredError:
        whose = (f"state_dict entry {self._key!r}" if self._key is not None
                 else f"a detached alias (.data / .detach()) of parameter {self._param!r}")
        if self._why == ONE_RANK:
            return ParameterNotGatheredError(f"{what} needs the values of {whose} (shape {list(self.shape)}, "
                                             f"{self.dtype}), {_ONE_RANK_NOTE}")
        return ParameterNotGatheredError(
            f"{what} needs the values of {whose} (shape {list(self.shape)}, {self.dtype}), a ZeRO-3 parameter that "
            "this rank holds only as a shard: the tensor has its shape and dtype but no values "
            f"(partita/zero/freed.py). {_INIT_NOTE if self._why == INIT else ''}{_HOW_TO_READ}"
        )

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _PLACEHOLDER_METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _PLACEHOLDER_OF and len(args) == 1 and not kwargs:
            return args[0]  # .data / .detach() of a placeholder: itself (still no values)
        raise _first_placeholder(args, kwargs)._error(describe(func))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # Reached only where torch functions are bypassed (C++ callers, DisableTorchFunction):
        # still no kernel may run on a tensor without data.
        raise _first_placeholder(args, kwargs or {})._error(f"torch op {func}")


# What a placeholder answers: metadata only, never values (nor .data, an alias for writing values).
_PLACEHOLDER_METADATA = frozenset(
    [getattr(_T, n).__get__ for n in ("shape", "dtype", "device", "ndim", "layout", "requires_grad", "is_leaf",
                                      "grad", "grad_fn", "is_meta", "is_cuda", "is_cpu", "is_sparse", "is_quantized",
                                      "is_nested", "names", "itemsize", "nbytes") if hasattr(_T, n)]
    + [getattr(_T, n) for n in ("size", "dim", "numel", "nelement", "element_size", "is_floating_point",
                                "is_complex", "is_signed", "is_contiguous", "stride", "get_device", "__len__",
                                "__hash__", "__dir__") if hasattr(_T, n)]
)


def _first_placeholder(args: tuple, kwargs: dict) -> NotGatheredPlaceholder:
    for leaf in tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, NotGatheredPlaceholder):
            return leaf
    raise AssertionError("a NotGatheredPlaceholder override ran without one")  # torch passes the overriding arg


def _guard_aliases(result: Any) -> Any:
    """Inside zero.Init: ``p.data``, ``p.detach()`` and views share the parameter's empty storage
    (so writes through them reach its shard) but are plain tensors: they become freed aliases too,
    whose reads are guarded like the parameter's, inside the context and after it."""
    if isinstance(result, torch.Tensor) and not isinstance(result, _Freed) and type(result) is torch.Tensor \
            and result.numel() and not _has_bytes(result):
        result.__class__ = _freed_class(torch.Tensor, INIT)
    return result


def _has_bytes(tensor: torch.Tensor) -> bool:
    """Whether the tensor's storage holds every element it addresses."""
    with torch._C.DisableTorchFunctionSubclass():
        if tensor.numel() == 0:
            return True
        last = tensor.storage_offset() + sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride()))
        return tensor.untyped_storage().nbytes() >= (last + 1) * tensor.element_size()


def _in_init_context(param: torch.Tensor) -> bool:
    return sharded_access_active() and type(param)._partita_why == INIT


def _whole_copy(param: torch.Tensor) -> torch.Tensor:
    """Inside zero.Init: a whole copy of a construction-sharded parameter (the dispatch mode gathers)."""
    with torch._C.DisableTorchFunctionSubclass():
        return param.detach().clone()


def _freed_class(cls: type, why: str) -> type:
    freed = _FREED_CLASS.get((cls, why))
    if freed is None:
        attrs = {"__module__": __name__, "__slots__": (), "_partita_base": cls, "_partita_why": why,
                 "_partita_alias": not issubclass(cls, nn.Parameter)}
        freed = _FREED_CLASS[(cls, why)] = type(f"Freed{cls.__name__}", (_Freed, cls), attrs)
    return freed


def _is_noop(param: torch.Tensor, func: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether the conversion would return ``param`` itself (reading nothing)."""
    with torch._C.DisableTorchFunctionSubclass():
        device, dtype = param.device, param.dtype
        if func in _CASTS:
            return _CASTS[func] == dtype and not args and not kwargs.get("memory_format")
        if func is _T.contiguous:
            return param.is_contiguous(*args, **kwargs)
        if func is _T.cpu:
            return device.type == "cpu" and not args and not kwargs.get("memory_format")
        if func is _T.cuda:
            if device.type != "cuda" or kwargs.get("memory_format"):
                return False
            index = args[0] if args else kwargs.get("device")
            target = torch.device("cuda", index) if isinstance(index, int) else torch.device(index or "cuda")
            return device.index == (torch.cuda.current_device() if target.index is None else target.index)
        kwargs = dict(kwargs)
        if kwargs.pop("copy", False):
            return False
        target, to_dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    if target is not None:
        if target.type != device.type:
            return False
        if target.index is None and target.type == "cuda":
            target = torch.device("cuda", torch.cuda.current_device())
        if target.index is not None and target != device:
            return False
    if to_dtype is not None and to_dtype != dtype:
        return False
    return memory_format in (None, torch.preserve_format)


def _name(param: torch.Tensor) -> str:
    name = _NAME.get(param)
    return repr(name) if name is not None else "unnamed"


def freed_error(param: torch.Tensor, what: str) -> ParameterNotGatheredError:
    """The error for reading ``param``'s values while it is freed, saying why it is and what to do."""
    with torch._C.DisableTorchFunctionSubclass():
        shape, dtype = list(param.shape), param.dtype
    why = reason_of(param)
    if why == ONE_RANK:
        return ParameterNotGatheredError(f"{what} needs the values of parameter {_name(param)} (shape {shape}, "
                                         f"{dtype}), {_ONE_RANK_NOTE}")
    return ParameterNotGatheredError(
        f"{what} needs the values of parameter {_name(param)} (shape {shape}, {dtype}), a ZeRO-3 parameter that this "
        "rank holds only as a shard: outside its unit's forward and backward it is whole only inside "
        "partita.zero.GatheredParameters (partita/zero/freed.py). "
        f"{_INIT_NOTE if why == INIT else ''}{_HOW_TO_READ}"
    )


def describe(func: Any) -> str:
    """How an error names the torch function that needed values."""
    name = getattr(func, "__name__", str(func))
    if name == "__reduce_ex__":
        return "pickling (torch.save, multiprocessing, all_gather_object)"
    if name == "__deepcopy__":
        return "copy.deepcopy"
    owner = getattr(func, "__self__", None)
    if name in ("__get__", "__set__") and owner is not None:
        return ("assigning " if name == "__set__" else "") + f"Tensor.{getattr(owner, '__name__', owner)}"
    return f"{name}()" if not name.startswith("__") else name
