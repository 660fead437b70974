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

The signature carries the annotation objects, as a signature written out
without postponed evaluation would (optax's common tests find a schedulable
argument by ``annotation in (optax.ScalarOrSchedule, optax.Schedule)``), while
``__annotations__`` keeps them as written, the strings that Sphinx shows by
their public names. :func:`runtime_signature` does the same for a function
with a written-out signature.
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

    # As written, as the docs show them; typing.get_type_hints resolves them where ``fn`` is
    # defined, so a name the group uses must be importable there. Checked now, not in the docs.
    call.__annotations__ = {
      p.name: p.annotation for p in shown.parameters.values() if p.annotation is not p.empty
    }
    if shown.return_annotation is not shown.empty:
      call.__annotations__["return"] = shown.return_annotation
    typing.get_type_hints(call)
    call.__signature__ = _resolved(shown, fn.__globals__)  # type: ignore[attr-defined]
    return cast(F, call)

  return decorate


def runtime_signature(fn: F) -> F:
  """Gives ``fn``'s signature its annotation objects; ``__annotations__`` stays as written.

  Under postponed evaluation (``from __future__ import annotations``) the
  signature's annotations are strings, and a test that looks for
  ``optax.ScalarOrSchedule`` by identity or equality (optax's common optimizer
  tests do) finds no schedulable argument.

  Args:
    fn: a function whose annotations resolve in its module.

  Returns:
    ``fn`` itself, with ``__signature__`` set.
  """
  fn.__signature__ = _resolved(inspect.signature(fn), fn.__globals__)  # type: ignore[attr-defined]
  return fn


def _resolved(signature: inspect.Signature, namespace: dict[str, Any]) -> inspect.Signature:
  """``signature`` with each string annotation evaluated in ``namespace`` (a module's globals).

  As ``inspect.signature(fn, eval_str=True)``: the expression is evaluated, the forward
  references inside the objects it names (``optax.Updates``' own) are left as they are.
  """
  evaluated = lambda a: eval(a, namespace) if isinstance(a, str) else a
  parameters = [
    p.replace(annotation=evaluated(p.annotation)) for p in signature.parameters.values()
  ]
  return signature.replace(
    parameters=parameters, return_annotation=evaluated(signature.return_annotation)
  )
