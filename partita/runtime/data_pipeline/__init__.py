"""``deepspeed.runtime.data_pipeline``: DeepSpeed's data-efficiency library (curriculum learning,
random layerwise token dropping, data sampling and analysis). partita has the legacy curriculum's
``curriculum_scheduler.CurriculumScheduler`` (the top-level ``"curriculum_learning"`` section); the
rest is not in partita: ``data_routing.helper`` imports, and each of its names raises
:class:`partita.MissingDeepSpeedFeature` saying so."""

_WHY = ("DeepSpeed's data-efficiency library (data sampling, random-LTD) is not part of partita; a "
        "config that enables \"data_efficiency\" is refused at initialize")

from partita.runtime._missing import submodules  # noqa: E402

__getattr__ = submodules(__name__)  # the submodules, on first use
