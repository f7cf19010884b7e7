"""The decorators of the pure core's value classes: records (`frozen`) and
commands (`command`), attrs slots classes that share one `__repr__`.

attrs compiles each class's generated methods at import; its `__repr__` is the
largest of them (about 90 of the ~360 µs a class costs), and the 68 command and
record classes are made on every start of the server (start-up time,
docs/PERFORMANCE-ROUNDS.md). The shared function writes what attrs' own would:
`Put(pri=0, delay=0, ...)`. Equality, hashing, `__init__` (with converters),
immutability and slots are attrs' own, unchanged.
"""

from __future__ import annotations

from typing import Any, TypeVar, dataclass_transform

import attrs

T = TypeVar("T")


def _repr(self: Any) -> str:
    fields = ", ".join(f"{a.name}={getattr(self, a.name)!r}" for a in self.__attrs_attrs__)
    return f"{self.__class__.__qualname__.rsplit('>.', 1)[-1]}({fields})"


@dataclass_transform(frozen_default=True, field_specifiers=(attrs.field,))
def frozen(cls: type[T]) -> type[T]:
    """`attrs.frozen(slots=True)` with the shared `__repr__`."""
    made = attrs.frozen(slots=True, repr=False)(cls)
    made.__repr__ = _repr  # type: ignore[method-assign]
    return made


@dataclass_transform(field_specifiers=(attrs.field,))
def command(cls: type[T]) -> type[T]:
    """A command: made once per line read and never changed after, but not
    attrs.frozen, whose `__init__` sets each field through `object.__setattr__`
    (a Put cost four times a plain slotted one, a tenth of a put's instructions
    in the loop). Still compared and hashed by value; the shared `__repr__`."""
    made = attrs.define(slots=True, unsafe_hash=True, repr=False)(cls)
    made.__repr__ = _repr  # type: ignore[method-assign]
    return made
