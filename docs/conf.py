"""Sphinx configuration of partita's documentation site (build: see docs/index.md, "Building")."""

project = "partita"
author = "partita contributors"
copyright = "2026, partita contributors"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
# reference/api.md documents the entry points from their docstrings; the signatures' annotations
# name torch and partita internals that are not pages of this site, so they are left out
# (nitpicky mode would report each one).
autodoc_typehints = "none"
autodoc_member_order = "bysource"
# Markdown pages only; the headings of levels 1-3 get GitHub-style anchors, so `page.md#a-heading`
# links work both on GitHub and in the built site (sphinx -n checks them).
source_suffix = {".md": "markdown"}
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]
# docs/ files that are not pages of the site (scripts are .py, never read as pages).
exclude_patterns = ["_build", "performance/_generated"]  # _generated: included by performance/index.md
# The guides written before the site skip heading levels (H1 to H3); that is cosmetic only.
suppress_warnings = ["myst.header"]
html_theme = "furo"
html_title = "partita"
