"""Name -> function registries that a user package can add to.

The loss code looks its pieces up by name (``advantage_estimator``, ``loss_agg_mode``,
``ratio_mode`` in the config). Each kind has one :class:`Registry`; the built-ins are
registered with the same decorator a user package uses::

    from rllib_exgrpo.core.losses import register_advantage_estimator

    @register_advantage_estimator("rank")
    def rank_advantage(rewards, group_index, eps=1e-6):
        ...

A name is looked up when it is used (and when a config is validated), so a name
registered before the config is built and trained passes both. Registration happens per
process: the module that registers must also be imported by the processes that compute
the loss (the learners), see ``docs/ALGORITHMS.md``.
"""

from __future__ import annotations

from typing import Callable, Dict, Generic, Iterator, Optional, Tuple, TypeVar

__all__ = ["ChoiceCheck", "Registry", "RegistryError"]

F = TypeVar("F", bound=Callable)


class RegistryError(ValueError):
    """An unknown name, or a name registered twice."""


class Registry(Generic[F]):
    """An ordered ``name -> function`` table of one kind (``kind`` names it in errors).

    Iterating, ``in`` and :meth:`names` see the names in registration order (the
    built-ins first). Read-only as a mapping: add with :meth:`register`.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: Dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator adding the function under ``name``; the function is returned as is.

        Raises :class:`RegistryError` if ``name`` is taken or not a non-empty string.
        """
        if not isinstance(name, str) or not name:
            raise RegistryError(f"a {self.kind} name must be a non-empty string, got {name!r}")

        def decorator(fn: F) -> F:
            if name in self._items:
                raise RegistryError(f"{self.kind} {name!r} is already registered (to {_qualname(self._items[name])}); pick another name")
            if not callable(fn):
                raise RegistryError(f"{self.kind} {name!r} must be a function, got {fn!r}")
            self._items[name] = fn
            return fn

        return decorator

    def unregister(self, name: str) -> F:
        """Remove ``name`` and return its function (for tests and interactive reloads)."""
        return self._items.pop(self._check(name))

    def get(self, name: str) -> F:
        """The function registered under ``name``; :class:`RegistryError` (a ``ValueError``)
        naming every known choice if there is none."""
        return self._items[self._check(name)]

    __getitem__ = get

    def names(self) -> Tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._items)

    def choice_check(self) -> "ChoiceCheck":
        """A config check accepting the names registered *when it runs* (see
        :class:`ChoiceCheck`), so a name registered after the config table was built passes."""
        return ChoiceCheck(self)

    def _check(self, name: str) -> str:
        if not isinstance(name, str) or name not in self._items:
            raise RegistryError(f"unknown {self.kind} {name!r}; choose from {list(self._items)}")
        return name

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self._items)})"


class ChoiceCheck:
    """A config field check (``rllib_exgrpo.rllib.config_fields``): ``check(value)`` is
    ``None`` when ``value`` is a registered name, else what it must be; ``describe`` says
    the rule. Both read the registry at the time of the call. ``annotation`` is the field's
    type for type checkers: ``str``, as a user package may register more names."""

    annotation = "str"

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    @property
    def describe(self) -> str:
        return f"one of {list(self.registry.names())}"

    def __call__(self, value: object) -> Optional[str]:
        return None if value in self.registry else self.describe


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
