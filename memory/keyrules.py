"""Key conditions: the declarative language in which checkpoint families (``memory.families``) and upscaler
architectures (``upscale.detect``) say how they are recognised (GUIDE convention 6).

A rule is decided from tensor *names and shapes only* (a safetensors header is enough), never from class names,
file names or tensor values. ``Shapes`` maps each key to its shape. Conditions:

- ``Has(key)``: the key is present; with ``ndim`` its shape has that many dimensions, with ``axis``/``size`` its
  size along ``axis`` is ``size``;
- ``Lacks(key)``: the key is absent;
- ``AllOf`` / ``AnyOf`` / ``NoneOf``: every / at least one / none of the nested conditions hold. The builders
  ``all_of``, ``any_of`` and ``none_of`` also take plain key names, read as ``Has(key)``.

A registry is a tuple of rows, each with a ``rule``; ``first_match`` returns the first row whose rule holds, so a
registry is ordered from the most to the least specific row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Protocol, Sequence, TypeVar, Union

Shapes = Mapping[str, Sequence[int]]


class Condition(Protocol):
    def holds(self, shapes: Shapes) -> bool: ...


@dataclass(frozen=True)
class Has:
    """The key is present (and, when ``ndim``/``axis`` are given, its shape matches)."""

    key: str
    ndim: Optional[int] = None
    axis: Optional[int] = None
    size: Optional[int] = None

    def holds(self, shapes: Shapes) -> bool:
        shape = shapes.get(self.key)
        if shape is None:
            return False
        if self.ndim is not None and len(shape) != self.ndim:
            return False
        if self.axis is not None and (len(shape) <= self.axis or shape[self.axis] != self.size):
            return False
        return True


@dataclass(frozen=True)
class Lacks:
    """The key is absent."""

    key: str

    def holds(self, shapes: Shapes) -> bool:
        return self.key not in shapes


@dataclass(frozen=True)
class AllOf:
    conditions: tuple

    def holds(self, shapes: Shapes) -> bool:
        return all(c.holds(shapes) for c in self.conditions)


@dataclass(frozen=True)
class AnyOf:
    conditions: tuple

    def holds(self, shapes: Shapes) -> bool:
        return any(c.holds(shapes) for c in self.conditions)


@dataclass(frozen=True)
class NoneOf:
    conditions: tuple

    def holds(self, shapes: Shapes) -> bool:
        return not any(c.holds(shapes) for c in self.conditions)


Item = Union[str, Condition]


def _conditions(items: tuple) -> tuple:
    return tuple(Has(item) if isinstance(item, str) else item for item in items)


def all_of(*items: Item) -> AllOf:
    return AllOf(_conditions(items))


def any_of(*items: Item) -> AnyOf:
    return AnyOf(_conditions(items))


def none_of(*items: Item) -> NoneOf:
    return NoneOf(_conditions(items))


def shapes_of(tensors: Mapping) -> dict:
    """``{key: shape}`` of a state dict (a value without a ``shape`` counts as a 0-D entry: present, no sizes)."""
    return {key: tuple(getattr(value, "shape", ())) for key, value in tensors.items()}


Row = TypeVar("Row")


def first_match(registry: Sequence[Row], shapes: Shapes) -> Optional[Row]:
    """The first row of ``registry`` whose ``rule`` holds for ``shapes``, else None."""
    for row in registry:
        if row.rule.holds(shapes):
            return row
    return None
