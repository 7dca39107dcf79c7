"""Sphinx configuration: the pages under docs/ (Markdown, through MyST) and the API reference,
generated from the docstrings (reference.md), so the reference cannot drift from the code.

    .venv/bin/python -m sphinx -W -b html docs docs/_build/html
"""
project = "hvd_aps"
author = "the hvd_aps authors"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
# data the pages link to, not pages themselves
exclude_patterns = ["_build", "cluster", "tta"]
myst_heading_anchors = 4
autodoc_member_order = "bysource"
autodoc_typehints = "signature"

html_theme = "alabaster"
# links from the pages to the repository's files (examples/, scripts/, the README) are plain links
myst_url_schemes = ["http", "https"]
autodoc_inherit_docstrings = False  # torch's own docstrings are not in this reference
napoleon_use_ivar = True
