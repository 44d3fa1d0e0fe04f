"""Name → callable registries, in the manner of verl's `register_adv_est`.

A name maps to one callable. Registering a taken name with another callable raises; an unknown name raises and lists
the known ones. Wherever a name is accepted, a dotted import path (`my_package.rewards.my_reward`) works too.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class _Entry:
    obj: Callable
    factory: bool


class Registry:
    """A registry of callables of one kind (`"reward"`, `"advantage"`).

    An entry registered with `factory=True` is called with the user's parameters to build the callable
    (`get("tag_format", tags=["plan", "answer"])`); a plain entry takes no parameters.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, _Entry] = {}

    def register(self, name: str, obj: Callable | None = None, *, factory: bool = False):
        """Register `obj` under `name`; usable as a decorator (`@registry.register("name")`)."""
        if not isinstance(name, str) or not name or "." in name or ":" in name:
            raise ValueError(
                f"{self.kind} name {name!r} is invalid: use a non-empty name without '.' or ':' "
                "(dots mean an import path, colons start parameters)."
            )

        def add(fn: Callable) -> Callable:
            if not callable(fn):
                raise TypeError(f"register_{self.kind}({name!r}) got {fn!r}, which is not callable.")
            known = self._entries.get(name)
            if known is not None and known.obj is not fn:
                raise ValueError(
                    f"{self.kind} name {name!r} is already registered to {_describe(known.obj)}; "
                    f"pick another name for {_describe(fn)}."
                )
            self._entries[name] = _Entry(fn, factory)
            return fn

        return add if obj is None else add(obj)

    def names(self) -> list[str]:
        _load_builtins()
        return sorted(self._entries)

    def get(self, name: str | Callable, **params) -> Callable:
        """The callable registered as `name` (built with `params` if it is a factory), or imported from a path."""
        if callable(name):
            if params:
                raise ValueError(f"{self.kind} {_describe(name)} is already a callable; it takes no parameters.")
            return name
        if name not in self._entries and "." not in name:
            _load_builtins()
        if name in self._entries:
            entry = self._entries[name]
            if entry.factory:
                return entry.obj(**params)
            if params:
                raise ValueError(
                    f"{self.kind} {name!r} takes no parameters, got {sorted(params)}; remove them "
                    f"or use a factory {self.kind}."
                )
            return entry.obj
        if "." in name:
            obj = _import_path(name, self.kind)
            return obj(**params) if params else obj
        raise KeyError(
            f"unknown {self.kind} {name!r}. Known {self.kind}s: {', '.join(self.names()) or '(none)'}; "
            f"or give a dotted import path such as 'my_module.my_{self.kind}'."
        )


def _load_builtins() -> None:
    """Register the built-ins (`trl_grpo_ext` imports its modules lazily) before a registry answers a miss."""
    importlib.import_module("trl_grpo_ext").load_builtins()


def _describe(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _import_path(path: str, kind: str):
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise KeyError(f"{kind} {path!r}: cannot import module {module_name!r} ({exc}).") from exc
    try:
        obj = getattr(module, attr)
    except AttributeError as exc:
        raise KeyError(f"{kind} {path!r}: module {module_name!r} has no attribute {attr!r}.") from exc
    if not callable(obj):
        raise TypeError(f"{kind} {path!r} is {type(obj).__name__}, not a callable.")
    return obj
