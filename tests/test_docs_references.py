"""The generated reference pages (docs/reference/config.md, cli.md, compatibility.md,
deepspeed-paths.md) equal what docs/generate_references.py writes from the code now, and what it
writes is right: origins, the refused DeepSpeed keys with their accepted values, every CLI
subcommand, every DeepSpeed-path shim with the module each of its names really comes from."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pydantic
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("generate_references", ROOT / "docs" / "generate_references.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("generate_references", module)
    spec.loader.exec_module(module)
    return module


gen = _generator()


def test_generated_references_are_up_to_date() -> None:
    stale = [str(p.relative_to(ROOT)) for p in gen.stale()]
    assert not stale, f"{stale} differ from the code: run `python docs/generate_references.py` and commit the pages"


def test_check_mode_names_a_stale_page_and_a_rewrite_fixes_it(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(gen, "REFERENCE", tmp_path)
    assert gen.main(["--check"]) == 1  # nothing written yet: every page is missing
    assert gen.main([]) == 0
    assert gen.main(["--check"]) == 0
    page = tmp_path / "cli.md"
    page.write_text(page.read_text().replace("partita run", "partita walk", 1))
    capsys.readouterr()
    assert gen.main(["--check"]) == 1
    assert "cli.md is out of date: run python docs/generate_references.py" in capsys.readouterr().err


def _config_rows() -> dict[str, tuple]:
    from partita.config import PartitaConfig

    schema = gen._Schema(PartitaConfig.model_json_schema(mode="validation"))
    return {row[0]: row for row in gen.config_rows(schema, schema.root)}


def test_config_reference_marks_deepspeed_and_partita_keys() -> None:
    rows = _config_rows()
    origin = {path: row[3] for path, row in rows.items()}
    for path in ("train_batch_size", "zero_optimization.stage", "fp16.loss_scale_window",
                 "zero_optimization.offload_optimizer.device", "checkpoint.tag_validation"):
        assert origin[path] == "deepspeed", path
    # partita-only fields, and keys that inherit it from a partita-only section
    for path in ("seed", "zero_optimization.one_rank_gradient_fold", "checkpoint.save_dir",
                 "zero_optimization.offload_optimizer.tiers.headroom", "compile.backend", "throughput.peak_tflops"):
        assert origin[path] == "partita", path
    assert rows["fp16.initial_scale_power"][1:3] == ("integer ≥ 0, ≤ 40", "`16`")
    assert rows["zero_optimization.one_rank_gradient_fold"][1] == '`"auto"` | `"early"` | `"end"` | `"stream"`'


def test_the_model_marker_decides_the_origin_and_sections_pass_it_on() -> None:
    class Section(pydantic.BaseModel):
        ours: int = pydantic.Field(1, json_schema_extra={"origin": "partita"})
        plain: str = pydantic.Field("x", description="partita-only, says the prose, but prose decides nothing")

    class Root(pydantic.BaseModel):
        marked: Section = pydantic.Field(default_factory=Section, json_schema_extra={"origin": "partita"})
        unmarked: Section = pydantic.Field(default_factory=Section)
        top: int = 0

    schema = gen._Schema(Root.model_json_schema())
    origin = {row[0]: row[3] for row in gen.config_rows(schema, schema.root)}
    assert origin == {"marked": "partita", "marked.ours": "partita", "marked.plain": "partita",
                      "unmarked": "deepspeed", "unmarked.ours": "partita", "unmarked.plain": "deepspeed",
                      "top": "deepspeed"}


_PARTITA_WORDS = re.compile(r"^\s*(partita[- ]only|partita extension)\b", re.IGNORECASE)


def test_every_key_described_as_partitas_carries_the_marker() -> None:
    """The descriptions' own words ("partita-only", "partita extension") and the PARTITA_KEY
    marker never disagree: a new partita field must be marked for the reference to say so."""
    unmarked = [path for path, (_, _, _, origin, text) in _config_rows().items()
                if _PARTITA_WORDS.match(text) and origin != "partita"]
    assert not unmarked, f"mark these fields with json_schema_extra=PARTITA_KEY (partita/config/base.py): {unmarked}"


def test_compatibility_page_lists_every_refused_key_with_its_accepted_value() -> None:
    from partita.config.unsupported import UNSUPPORTED

    page = gen.render_compatibility()
    for section, entries in UNSUPPORTED.items():
        for name, entry in entries.items():
            path = ".".join(section + (name,))
            assert f"| `{path}` | `{gen._cell(entry.harmless_form())}` |" in page, path
    assert "[DeepSpeed import paths](deepspeed-paths.md)" in page  # the one table of shims is there


def _path_rows() -> dict[str, list[str]]:
    """partita module -> its row's cells, from the rendered DeepSpeed-paths page."""
    rows = {}
    for line in gen.render_deepspeed_paths().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 5 and cells[1].startswith("`partita"):
            rows[cells[1].strip("`")] = cells
    return rows


def test_deepspeed_paths_page_has_a_row_for_every_shim_module_file() -> None:
    """Found from the files, not by the generator's walk: a new shim module cannot be left out."""
    expected = set()
    for root in gen.SHIM_ROOTS:
        base = ROOT / root.replace(".", "/")
        files = [base.with_suffix(".py")] if base.with_suffix(".py").exists() else sorted(base.rglob("*.py"))
        for file in files:
            parts = file.relative_to(ROOT).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            if not any(p.startswith("_") for p in parts):
                expected.add(".".join(parts))
    rows = _path_rows()
    assert expected <= set(rows), sorted(expected - set(rows))
    assert rows["partita.runtime.zero.stage3"][0] == "`deepspeed.runtime.zero.stage3`"


_FORWARD = re.compile(r"`([\w.]+)`: ((?:`\w+`(?: \(`[\w.]+`\))?(?:, )?)+)")
_NAME = re.compile(r"`(\w+)`(?: \(`([\w.]+)`\))?")


def test_deepspeed_paths_forwards_name_where_each_export_is_defined() -> None:
    """Every "module: names" claim of the table holds: the shim's name is that module's object."""
    import importlib

    checked = 0
    for shim, cells in _path_rows().items():
        module = importlib.import_module(shim)
        for home, names in _FORWARD.findall(cells[3]):
            for name, defined in _NAME.findall(names):
                obj = getattr(module, name)
                real = importlib.import_module(home)
                if defined or not isinstance(obj, type(module)):
                    for part in (defined or name).split("."):
                        real = getattr(real, part)
                assert real is obj, (shim, name, home)
                checked += 1
    assert checked > 100, checked
    rows = _path_rows()
    assert "`partita.zero.init_context`: `Init`" in rows["partita.runtime.zero.partition_parameters"][3]
    assert "`LossScaler` (`StaticLossScaler`)" in rows["partita.runtime.fp16.loss_scaler"][3]
    assert rows["partita.runtime.zero.partition_parameters"][4] == "`ZeroParamStatus`"
    assert rows["partita.ops"][4] == "any other name"
    assert "`deepspeed.module_inject`" in rows["partita.deepspeed_compat"][4]
    assert "`deepspeed.moe`" not in rows["partita.deepspeed_compat"][4]  # partita.moe exists: not refused


def test_checkpointing_refusals_are_a_table_the_page_lists_and_both_import_forms_explain() -> None:
    """partita.checkpointing refuses through its MISSING table (not a hard-coded __getattr__), so the
    generated page lists the names and ``from ... import`` keeps the message instead of Python's own."""
    import partita.checkpointing as checkpointing
    from partita.runtime._missing import MissingDeepSpeedImport

    assert set(checkpointing.MISSING) == {"get_cuda_rng_tracker", "model_parallel_cuda_manual_seed"}
    assert _path_rows()["partita.checkpointing"][4] == "`get_cuda_rng_tracker`, `model_parallel_cuda_manual_seed`"
    with pytest.raises(NotImplementedError, match=r"^deepspeed\.checkpointing\.get_cuda_rng_tracker \(Megatron's.*\"seed\""):
        checkpointing.get_cuda_rng_tracker
    with pytest.raises(MissingDeepSpeedImport, match=r"^deepspeed\.checkpointing\.model_parallel_cuda_manual_seed "):
        from partita.checkpointing import model_parallel_cuda_manual_seed  # noqa: F401
    assert not hasattr(checkpointing, "no_such_name")  # other names: Python's plain AttributeError


def test_a_changed_reexport_makes_the_deepspeed_paths_page_stale(monkeypatch) -> None:
    import partita.runtime.engine as shim
    from partita.zero import Init

    monkeypatch.setattr(shim, "DeepSpeedEngine", Init)  # the shim now forwards elsewhere
    assert gen.REFERENCE / "deepspeed-paths.md" in gen.stale()
    assert "`partita.zero.init_context`: `DeepSpeedEngine` (`Init`)" in _path_rows()["partita.runtime.engine"][3]


def test_cli_page_has_every_subcommand_and_option() -> None:
    from partita.launcher.cli import build_parser

    page = gen.render_cli()
    for words, parser, _ in gen._commands(build_parser(), ["partita"]):
        assert f"\n## `{' '.join(words)}`\n" in page
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in page, (words, option)
    assert "| `--max-restarts` | `MAX_RESTARTS` | `0` |" in page


@pytest.mark.parametrize("text, expected", [
    ("see :class:`~partita.engine.Engine` and ``x``", "see `Engine` and `x`"),
    ("from :mod:`partita.pipe`", "from `partita.pipe`"),
])
def test_docstring_markup_becomes_markdown(text: str, expected: str) -> None:
    assert gen._markdown(text) == expected


def _performance_generator():
    spec = importlib.util.spec_from_file_location("generate_performance", ROOT / "docs" / "generate_performance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_performance_headline_table_is_rendered_from_the_raw_results(tmp_path: Path) -> None:
    perf = _performance_generator()
    for path, text in perf.outputs().items():
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is stale: run python docs/generate_performance.py"
    table = perf.render_table()
    # a figure of the run's JSON, as the suite's table code prints it
    assert "| partita3 | 55,247 | 50.7% |" in table and "gpu_suite_2gpu_s3_2026-11-29.json" in table
    perf.write_plot(tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
