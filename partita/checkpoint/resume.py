"""Resume at start: what ``checkpoint.resume: "latest"`` makes ``partita.initialize`` do.

With ``partita run --max-restarts K``, torchrun restarts every worker after a failure; the
restarted script calls ``initialize`` again, which loads the newest complete checkpoint in
``checkpoint.save_dir`` (skipping a damaged one, e.g. from a crash mid-save) so the loop can
continue from ``engine.global_steps``. With no checkpoint yet the run starts fresh.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from partita.engine import Engine

logger = logging.getLogger("partita")


def resume_from_config(engine: Engine) -> None:
    """Load the newest complete checkpoint of ``checkpoint.save_dir`` when ``checkpoint.resume`` asks for it."""
    section = engine.config.checkpoint if engine.config is not None else None
    if section is None or section.resume is None:
        return
    if not Path(section.save_dir).is_dir():
        # Every rank sees the same (shared) directory, so all skip the load together.
        logger.info("checkpoint.resume: %s does not exist yet; starting fresh", section.save_dir)
        return
    engine.load_checkpoint(section.save_dir)
