"""Keyword groups that several public functions share, declared once (PEP 692).

A group is a ``TypedDict`` (the names and their types) with a mapping of
defaults. A function takes it as ``**options: Unpack[Group]``, which type
checkers read keyword by keyword; :func:`takes_keywords` makes the running
function agree:

* ``inspect.signature`` lists the group's keywords with their defaults, so
  Sphinx, ``help()`` and ``optax.inject_hyperparams`` (which injects the
  numeric ones) see the same parameters as a written-out signature;
* a call gets every keyword of the group, the defaults filled in;
* an unknown keyword raises ``TypeError``, as for a written-out signature;
* ``typing.get_type_hints`` gives every parameter's type.

The annotations stay as written (strings, under postponed evaluation), which
the docs show by their public names; each must resolve in the module of the
decorated function, which is checked when it is decorated.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import TypeVar
from typing import cast

F = TypeVar("F", bound=Callable[..., Any])


def takes_keywords(group: type, defaults: Mapping[str, Any]) -> Callable[[F], F]:
  """Shows ``group``'s keywords in the decorated function's signature and fills in ``defaults``.

  The function's own ``**kwargs`` parameter (annotated ``Unpack[group]``) is
  replaced by the group's keywords, keyword-only, after its other parameters.

  Args:
    group: a ``TypedDict`` (``total=False``): the names and their annotations.
    defaults: the default of every name of ``group``.

  Returns:
    A decorator.
  """
  # Strings under postponed evaluation (a ForwardRef inside a TypedDict): shown as written.
  annotations = {
    name: getattr(annotation, "__forward_arg__", annotation)
    for name, annotation in group.__annotations__.items()
  }
  if set(annotations) != set(defaults):
    raise ValueError(
      f"{group.__name__}: the defaults name {sorted(defaults)}, the group {sorted(annotations)}."
    )

  def decorate(fn: F) -> F:
    signature = inspect.signature(fn)
    own = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    shared = [
      inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=defaults[name], annotation=a)
      for name, a in annotations.items()
    ]
    shown = signature.replace(parameters=[*own, *shared])

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
      try:
        bound = shown.bind(*args, **kwargs)
      except TypeError as error:  # the message Python gives, with the function's name
        raise TypeError(f"{fn.__name__}() {error}") from None
      bound.apply_defaults()
      return fn(**bound.arguments)

    call.__signature__ = shown  # type: ignore[attr-defined]
    # As written, as the docs show them; typing.get_type_hints resolves them where ``fn`` is
    # defined, so a name the group uses must be importable there. Checked now, not in the docs.
    call.__annotations__ = {
      p.name: p.annotation for p in shown.parameters.values() if p.annotation is not p.empty
    }
    if shown.return_annotation is not shown.empty:
      call.__annotations__["return"] = shown.return_annotation
    typing.get_type_hints(call)
    return cast(F, call)

  return decorate
