"""The allow-list of classes a checkpoint's non-tensor values may be instances of.

Enum, dataclass and NamedTuple instances are stored in the encoded form
(:mod:`distckpt.state.encoded`) by class name, ``module:qualname``; a save refuses classes not
listed, and a load (:mod:`distckpt.state.decoding`) rebuilds only listed ones, from the classes
the loading process registered, never from a name the checkpoint gives. The list is what
``Checkpointer(safe_types=[...])`` takes.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import sys
from collections.abc import Iterable, Mapping
from typing import Union

#: The kinds of class that can be registered (error messages name them).
REGISTRABLE = "an Enum, a dataclass or a NamedTuple"
#: The other values a checkpoint stores (error messages name them).
SUPPORTED = (
    "tensors, None/bool/int/float/complex/str/bytes, lists/tuples/dicts/sets of them, NumPy scalars, arrays "
    "and generators, datetime values, pathlib paths, deque, defaultdict, slice, range, Decimal, Fraction, UUID"
)

#: Classes allowed when a caller passes no ``safe_types`` (the Checkpointer passes its option).
DEFAULT_SAFE_TYPES: tuple[type, ...] = ()


#: How a launched script's module is named: by ``python train.py``/torchrun, and by the
#: processes ``torch.multiprocessing``'s spawn (or forkserver) starts.
SCRIPT_MODULES = frozenset({"__main__", "__mp_main__"})


def script_names() -> set[str]:
    """The names another script imports the running script by: its module name under
    ``python -m pkg.train`` (``pkg.train``) and its file's stem (``train`` for ``train.py``)."""
    main = sys.modules.get("__main__")
    names: set[str] = set()
    spec = getattr(main, "__spec__", None)
    if spec is not None and isinstance(getattr(spec, "name", None), str):
        names.add(spec.name)
    path = getattr(main, "__file__", None)
    if isinstance(path, str):
        names.add(os.path.splitext(os.path.basename(path))[0])
    return names - SCRIPT_MODULES


def type_name(cls: type) -> str:
    """How the encoded form names a registered class: ``module:qualname``."""
    return f"{cls.__module__}:{cls.__qualname__}"


def is_enum(cls: type) -> bool:
    return issubclass(cls, enum.Enum)


def is_dataclass(cls: type) -> bool:
    return dataclasses.is_dataclass(cls)


def is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and hasattr(cls, "_fields")


def registrable(cls: type) -> bool:
    """Whether ``cls`` is a class that can be registered (:data:`REGISTRABLE`)."""
    return is_enum(cls) or is_dataclass(cls) or is_namedtuple(cls)


@dataclasses.dataclass(frozen=True)
class SafeTypes:
    """The classes beyond the built-in ones whose instances a checkpoint may hold, by
    :func:`type_name`: what ``Checkpointer(safe_types=[...])`` lists. A save refuses instances
    of Enum, dataclass and NamedTuple classes not listed; a load rebuilds only listed ones."""

    by_name: Mapping[str, type] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, types: SafeTypesLike) -> SafeTypes:
        """Validate a ``safe_types`` argument (``None``: :data:`DEFAULT_SAFE_TYPES`).

        Raises:
            ValueError: an entry is not a class that can be registered, or two different
                classes share a name.
        """
        if isinstance(types, SafeTypes):
            return types
        if types is None:
            types = DEFAULT_SAFE_TYPES
        if isinstance(types, type):  # safe_types=Mode instead of [Mode]: an Enum class iterates its members
            raise ValueError(f"safe_types takes a list of classes, e.g. safe_types=[{types.__qualname__}]")
        if isinstance(types, (str, bytes)) or not isinstance(types, Iterable):
            raise ValueError(f"safe_types takes a list of classes, got {types!r}")
        by_name: dict[str, type] = {}
        for t in types:
            if not isinstance(t, type) or not registrable(t):
                raise ValueError(f"safe_types: {t!r} is not {REGISTRABLE} class; other values must be stored as {SUPPORTED}")
            name = type_name(t)
            if by_name.setdefault(name, t) is not t:
                raise ValueError(f"safe_types: two different classes are named {name}; a checkpoint could not tell them apart")
        return cls(by_name)

    def find(self, name: str) -> type | None:
        """The registered class a checkpoint's ``module:qualname`` names, else ``None``. Where none
        has that exact name, the one registered class of that qualname is taken when either side's
        module is a launched script's (``__main__`` under ``python train.py`` or torchrun,
        ``__mp_main__`` under ``torch.multiprocessing`` spawn): the same class of the training
        script is named by how it was launched, and ``train:Phase`` where another script imports
        it. The class is the caller's own registered one either way; nothing is imported."""
        cls = self.by_name.get(name)
        if cls is not None:
            return cls
        module, _, qualname = name.partition(":")
        same = self.named(qualname)
        if len(same) != 1:
            return None  # none, or several: never guessed between
        if module in SCRIPT_MODULES or (same[0].__module__ in SCRIPT_MODULES and module in script_names()):
            # Saved by a launched script (any registered class of that name is its class here),
            # or by a script importing this one, which is running as the script now. A class of
            # any other module (a library's Enum of the same name) is not this script's.
            return same[0]
        return None

    def named(self, qualname: str) -> list[type]:
        """The registered classes whose qualified name is ``qualname`` (in any module)."""
        return [t for n, t in self.by_name.items() if n.partition(":")[2] == qualname]

    def allows(self, cls: type) -> bool:
        """Whether ``cls`` itself (not another class of the same name) is registered."""
        return self.by_name.get(type_name(cls)) is cls


#: What functions taking ``safe_types`` accept: a :class:`SafeTypes`, classes, or ``None``
#: (:data:`DEFAULT_SAFE_TYPES`).
SafeTypesLike = Union[SafeTypes, Iterable[type], None]
