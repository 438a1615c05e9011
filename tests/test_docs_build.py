"""The documentation site builds with every warning an error (broken references and anchors
included: sphinx's nitpicky mode), and the README's links point at files that exist."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_sphinx_build_has_no_warnings(tmp_path: Path) -> None:
    missing = [name for name in ("sphinx", "myst_parser", "furo") if importlib.util.find_spec(name) is None]
    assert not missing, f"{missing} not installed: pip install -e '.[docs]' (CI installs it, as the README says)"
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html",
               str(ROOT / "docs"), str(tmp_path / "html"), "-d", str(tmp_path / "doctrees")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    warnings = [line for line in done.stderr.splitlines() if "WARNING:" in line and str(ROOT / "docs") in line
                or "ERROR" in line or "partita" in line and "WARNING:" in line]
    assert done.returncode == 0, "sphinx-build -W -n failed:\n" + "\n".join(warnings or done.stderr.splitlines()[-30:])
    assert (tmp_path / "html" / "reference" / "config.html").exists()


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _readme_links() -> list[str]:
    text = re.sub(r"```.*?```", "", (ROOT / "README.md").read_text(), flags=re.S)
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z]+://", t)]


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6} (.+)$", markdown, flags=re.M)}


def test_readme_links_resolve() -> None:
    links = _readme_links()
    assert len(links) >= 20  # the feature table links every guide
    broken = []
    for link in links:
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else ROOT / "README.md"
        if not target.exists():
            broken.append(link)
        elif anchor and anchor not in _anchors(target.read_text()):
            broken.append(link)
    assert not broken, f"README.md links to missing files or headings: {broken}"


def test_every_dated_report_is_on_the_site() -> None:
    """A report the benchmark scripts write to benchmarks/results/<date>-report.md needs its page
    (docs/performance/reports/<date>.md, an include of it) and a line in the performance page."""
    index = (ROOT / "docs" / "performance" / "index.md").read_text()
    missing = []
    for report in sorted((ROOT / "benchmarks" / "results").glob("*-report.md")):
        date = report.name.removesuffix("-report.md")
        page = ROOT / "docs" / "performance" / "reports" / f"{date}.md"
        if not page.exists() or f"benchmarks/results/{report.name}" not in page.read_text() \
                or f"(reports/{date}.md)" not in index:
            missing.append(report.name)
    assert not missing, (f"{missing}: add docs/performance/reports/<date>.md (an include of the report, as the "
                         "others) and link it under 'Dated reports' in docs/performance/index.md")
