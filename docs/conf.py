"""Sphinx configuration of the optax_gsam documentation site.

Build: ``sphinx-build -W --keep-going -b html docs docs/_build/html``
(``tests/test_docs_build.py`` runs the same build with warnings as errors).
"""

import re

import optax_gsam

project = "optax_gsam"
author = "optax_gsam developers"
copyright = "optax_gsam developers"
release = optax_gsam.__version__
version = release

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",
  "sphinx.ext.intersphinx",
  "sphinx.ext.mathjax",
  # MathJax 3 from the sphinx-mathjax-offline package, copied into _static/mathjax: the pages
  # render their maths without a network (no CDN).
  "sphinx-mathjax-offline",
]

# MathJax's textmacros extension (in the offline bundle): `\text{minimize\_fp}` shows an
# underscore, not a backslash and one.
mathjax3_config = {
  "loader": {"load": ["[tex]/textmacros"]},
  "tex": {"packages": {"[+]": ["textmacros"]}},
}

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
# The field types are in the class signature; napoleon would repeat them evaluated, under the
# private module paths of their classes (jax.Array is jaxlib._jax.Array).
napoleon_attr_annotations = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# Type aliases are shown by their public name, linked (the modules use string annotations, and
# autodoc would otherwise print the expansion or the private name written in the source):
# optax's through the local optax inventory, optax_gsam's to their entries in optax_gsam.typing.
_OPTAX_ALIASES = ("ScalarOrSchedule", "Schedule", "Params", "Updates", "OptState")
_PUBLIC_ALIASES = ("Adaptive", "AxisName", "DecideFn", "EmbedFn", "EmbeddingLossFn")
autodoc_type_aliases = {
  **{f"optax.{name}": f"optax.{name}" for name in _OPTAX_ALIASES},
  **{name: f"optax_gsam.typing.{name}" for name in _PUBLIC_ALIASES},
  # Classes whose __module__ is private (jax.Array is jaxlib._jax.Array, optax's transformations
  # live in optax._src.base): kept as the public name the source writes.
  **{
    name: name
    for name in (
      "jax.Array",
      "optax.GradientTransformation",
      "optax.GradientTransformationExtraArgs",
      "jax.sharding.Mesh",
      "jax.sharding.Sharding",
    )
  },
  "Mesh": "jax.sharding.Mesh",
}
autodoc_class_signature = "mixed"
add_module_names = True

# Every cross-reference must resolve, optax_gsam's own and those to Python, JAX and optax alike: a misspelt `optax.Shedule` in a signature fails the build. The builds have no
# network, so intersphinx reads small local inventories of the names the docs use
# (docs/_inventories/*.inv, written by tools/make_inventories.py; add a name there when a
# signature starts to use it). The links point at each project's online documentation.
nitpicky = True
intersphinx_mapping = {
  project: (url, f"_inventories/{project}.inv")
  for project, url in {
    "python": "https://docs.python.org/3/",
    "jax": "https://docs.jax.dev/en/latest/",
    "optax": "https://optax.readthedocs.io/en/latest/",
  }.items()
}
intersphinx_timeout = 1  # never wait on a network: the inventories are local files

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
