"""Sphinx configuration of the optax_gsam documentation site.

Build: ``sphinx-build -W --keep-going -b html docs docs/_build/html``
(``tests/test_docs_build.py`` runs the same build with warnings as errors).
"""

import re

import optax_gsam

project = "optax_gsam"
author = "optax_gsam authors"
copyright = "optax_gsam authors"
release = optax_gsam.__version__
version = release

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",
  "sphinx.ext.mathjax",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "configs", "Thumbs.db", ".DS_Store"]

# MyST: $...$ and $$...$$ maths, ```{math} blocks, heading anchors for [text](page.md#anchor).
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# autodoc + napoleon: the docstrings are Google style, with reST maths and roles.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # NamedTuple "Attributes:" as fields, not duplicate attribute entries.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# Show optax's aliases by name instead of their expansion (the modules use string annotations).
autodoc_type_aliases = {
  name: name
  for name in (
    "optax.ScalarOrSchedule",
    "optax.Schedule",
    "optax.Params",
    "optax.Updates",
    "optax.OptState",
    "pert.Adaptive",
    "AxisName",
    "EmbedFn",
    "LossFn",
  )
}
autodoc_class_signature = "mixed"
add_module_names = True

# Every cross-reference must resolve (a broken :func:`optax_gsam.x` fails the build), except the
# type hints of other libraries: without network access there is no intersphinx inventory for them.
nitpicky = True
nitpick_ignore_regex = [("py:class", r"(?!optax_gsam\.).*")]

html_theme = "furo"
html_title = f"optax_gsam {release}"
html_static_path = []


def _tidy_signature(app, what, name, obj, options, signature, return_annotation):
  """Writes an alias nested in a union or Callable by name, as at the top level."""
  del app, what, name, obj, options

  def tidy(text):
    return text and re.sub(r"TypeAliasForwardRef\('([\w.]+)'\)", r"\1", text)

  return tidy(signature), tidy(return_annotation)


def setup(app):
  app.connect("autodoc-process-signature", _tidy_signature)
