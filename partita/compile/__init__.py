"""torch.compile per repeated block, at every ZeRO stage.

- the config's ``compile`` section (:class:`CompileConfig`) makes ``initialize`` compile;
- ``engine.compile(backend=..., compile_kwargs={...})`` does the same afterwards (DeepSpeed's method);
- :func:`compile_blocks` is the function both call; :func:`compiled_blocks` and
  :func:`compile_stats` say what is compiled and how often TorchDynamo recompiled it.
"""

from partita.compile.apply import compile_blocks, compile_stats, compiled_blocks
from partita.compile.compiled_forward import CompiledForward, CompileStats
from partita.compile.config import CompileConfig

__all__ = ["CompileConfig", "compile_blocks", "compiled_blocks", "compile_stats", "CompiledForward", "CompileStats"]
