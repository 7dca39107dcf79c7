"""The base of every configured choice: an enum whose values are the choices' text, so a
setting given as a string ("nearest", "cuda") is parsed once, at the edge, into a member that
compares equal to it and prints as it on every Python."""
import enum


class Choice(str, enum.Enum):
    """A string choice: compares equal to its value, prints as it, on every Python."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    # hashed as its text, which it equals (Enum's own hash is its member name's): str's C slot, no
    # Python call where a member keys a cache
    __hash__ = str.__hash__

    @classmethod
    def parse(cls, value, what: str):
        """`value` (a member or its text) as a member; a ValueError naming `what` and the choices."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{what} must be one of {[c.value for c in cls]}, got {value!r}") from None
