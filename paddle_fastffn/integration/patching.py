"""Class attributes replaced so that revert restores exactly what was there: the raw descriptor the
class itself held (a staticmethod object stays that same object), or no attribute at all where the
class inherited it (setting the inherited function on the subclass would shadow any later change of
the base class)."""

from __future__ import annotations

INHERITED = object()  # the class held no attribute of its own under that name


def own_attribute(cls: type, name: str):
    """What `cls` itself holds under `name` (its __dict__ entry), or INHERITED."""
    return cls.__dict__.get(name, INHERITED)


def restore_attribute(cls: type, name: str, saved) -> None:
    """Put back what own_attribute returned."""
    if saved is INHERITED:
        if name in cls.__dict__:
            delattr(cls, name)
    else:
        setattr(cls, name, saved)
