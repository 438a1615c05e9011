"""``deepspeed.runtime.data_pipeline``: DeepSpeed's data-efficiency library (curriculum learning,
random layerwise token dropping, data sampling and analysis). None of it is in partita: its
submodules ``curriculum_scheduler`` and ``data_routing.helper`` import, and each name raises
:class:`partita.MissingDeepSpeedFeature` saying so."""

_WHY = ("DeepSpeed's data-efficiency library (curriculum learning, random-LTD) is not part of partita; a "
        "config that enables \"curriculum_learning\" or \"data_efficiency\" is refused at initialize")

from partita.runtime._missing import submodules  # noqa: E402

__getattr__ = submodules(__name__)  # the submodules, on first use
