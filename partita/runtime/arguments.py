"""``deepspeed.add_config_arguments(parser)``: DeepSpeed's command-line flags, same names and defaults.

    parser = argparse.ArgumentParser()
    parser = partita.add_config_arguments(parser)
    args = parser.parse_args()              # args.deepspeed_config -> initialize(args=args, ...)

``--deepspeed`` and ``--deepscale`` are flags for the script's own use (DeepSpeed ignores
them too). ``--deepspeed_config`` names the JSON config that ``initialize(args=args)`` reads.
``--deepscale_config`` is DeepSpeed's deprecated spelling: it warns and fills
``deepspeed_config`` (as DeepSpeed's ``initialize`` does with it), unless ``--deepspeed_config``
is given as well.
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

__all__ = ["add_config_arguments"]


class _DeprecatedConfigPath(argparse.Action):
    """``--deepscale_config PATH``: kept, and copied to ``deepspeed_config`` when that is unset."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        warnings.warn("--deepscale_config is deprecated (DeepSpeed's old name); use --deepspeed_config",
                      DeprecationWarning, stacklevel=2)
        setattr(namespace, self.dest, values)
        if getattr(namespace, "deepspeed_config", None) is None:
            namespace.deepspeed_config = values


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's four flags to ``parser`` (in a "DeepSpeed" group) and return it."""
    if not isinstance(parser, argparse.ArgumentParser):
        raise ValueError(f"add_config_arguments(parser) needs an argparse.ArgumentParser, got {type(parser).__name__}")
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on the engine)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact on the engine)")
    group.add_argument("--deepscale_config", default=None, type=str, action=_DeprecatedConfigPath,
                       help="Deprecated DeepSpeed json configuration file.")
    return parser
