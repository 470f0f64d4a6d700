"""Reading and checking the fields of one wire map; every failure names its field."""

from __future__ import annotations

import math
from typing import Any, Callable, TypeVar

from array import array

from prefixd.ipc.errors import ErrorCode, ProtocolError

T = TypeVar("T")
MAX_ID = (1 << 63) - 1
MAX_TOKEN_ID = (1 << 31) - 1
_MISSING: Any = object()


class FieldReader:
    """Takes fields out of `data` one by one; `finish()` rejects the fields nobody took.

    `where` prefixes field names in errors ("images[0].rows"); errors answer `request_id`.
    With `strict=False` unknown fields are ignored (how clients read server events).
    """

    REQUIRED: Any = _MISSING  # the default that makes a field required

    def __init__(
        self, data: Any, where: str = "", request_id: int | None = None, strict: bool = True
    ) -> None:
        self.where = ""
        self.request_id = request_id
        self.strict = strict
        if type(data) is not dict:
            raise self.error(where.rstrip(".") or "message", "must be a map")
        self.where = where
        self.data = data
        self._taken: set[str] = set()

    def error(self, name: str, why: str, code: ErrorCode = ErrorCode.BAD_REQUEST) -> ProtocolError:
        return ProtocolError(code, f"{self.where}{name}: {why}", self.request_id)

    def _take(self, name: str, default: Any) -> Any:
        self._taken.add(name)
        value = self.data.get(name, _MISSING)
        if value is _MISSING or value is None:
            if default is _MISSING:
                raise self.error(name, "required")
            return default
        return value

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def int(self, name: str, default: Any = _MISSING, lo: int = 0, hi: int = MAX_ID) -> Any:
        value = self._take(name, default)
        if value is default:
            return value
        if type(value) is not int:
            raise self.error(name, f"must be an integer, got {_kind(value)}")
        if not lo <= value <= hi:
            raise self.error(name, f"{value} outside [{lo}, {hi}]")
        return value

    def float(self, name: str, default: Any = _MISSING, lo: float = -math.inf, hi: float = math.inf) -> Any:
        value = self._take(name, default)
        if value is default:
            return value
        if type(value) not in (int, float) or not math.isfinite(value):
            raise self.error(name, f"must be a finite number, got {_kind(value)}")
        if not lo <= value <= hi:
            raise self.error(name, f"{value} outside [{lo}, {hi}]")
        return float(value)

    def bool(self, name: str, default: Any = _MISSING) -> Any:
        value = self._take(name, default)
        if value is default:
            return value
        if type(value) is not bool:
            raise self.error(name, f"must be a boolean, got {_kind(value)}")
        return value

    def str(self, name: str, default: Any = _MISSING, choices: tuple[str, ...] = ()) -> Any:
        value = self._take(name, default)
        if value is default:
            return value
        if type(value) is not str:
            raise self.error(name, f"must be a string, got {_kind(value)}")
        if choices and value not in choices:
            raise self.error(name, f"{value!r} is not one of {', '.join(choices)}")
        return value

    def bytes(self, name: str, default: Any = _MISSING) -> Any:
        value = self._take(name, default)
        if value is default:
            return value
        if type(value) not in (bytes, memoryview):
            raise self.error(name, f"must be binary, got {_kind(value)}")
        return value

    def map(self, name: str, default: Any = _MISSING) -> Any:
        value = self._take(name, default)
        if value is not default and type(value) is not dict:
            raise self.error(name, f"must be a map, got {_kind(value)}")
        return value

    def list(self, name: str, default: Any = _MISSING) -> Any:
        """An array of any values (an int32 memfd array is not one: only `ints` takes those)."""
        value = self._take(name, default)
        if value is not default and type(value) is not list:
            raise self.error(name, f"must be an array, got {_kind(value)}")
        return value

    def ints(
        self, name: str, default: Any = _MISSING, hi: int = MAX_ID, code: ErrorCode = ErrorCode.BAD_REQUEST
    ) -> Any:
        """A tuple of non-negative ints <= hi; an out-of-range value raises with `code`.

        A memfd int32 array (array.array) is range-checked as an array before any tuple is built."""
        value = self._take(name, default)
        if value is default:
            return value
        if type(value) is array:
            return self._int_array(name, value, hi, code)
        if type(value) is not list:
            raise self.error(name, f"must be an array, got {_kind(value)}")
        if not all(type(v) is int for v in value):
            bad = next(v for v in value if type(v) is not int)
            raise self.error(name, f"must hold integers, got {_kind(bad)}")
        if value and (min(value) < 0 or max(value) > hi):
            bad = next(v for v in value if not 0 <= v <= hi)
            raise self.error(name, f"{bad} outside [0, {hi}]", code)
        return tuple(value)

    def _int_array(self, name: str, value: array, hi: int, code: ErrorCode) -> tuple[int, ...]:
        if value.typecode not in "bBhHiIlLqQ":
            raise self.error(name, f"must hold integers, got {value.typecode!r} values")
        if value and (min(value) < 0 or max(value) > hi):
            bad = next(v for v in value if not 0 <= v <= hi)
            raise self.error(name, f"{bad} outside [0, {hi}]", code)
        return tuple(value)

    def strs(self, name: str, default: Any = _MISSING) -> Any:
        value = self.list(name, default)
        if value is default:
            return value
        for i, item in enumerate(value):
            if type(item) is not str:
                raise self.error(f"{name}[{i}]", f"must be a string, got {_kind(item)}")
        return tuple(value)

    def nested(self, name: str, value: Any, strict: bool | None = None) -> FieldReader:
        """A reader for a map inside this one, e.g. `nested("sampling", data)`."""
        return FieldReader(
            value, f"{self.where}{name}.", self.request_id, self.strict if strict is None else strict
        )

    def each(self, name: str, items: list[Any], read: Callable[[FieldReader], T]) -> tuple[T, ...]:
        """`read` applied to a reader over each map of the array `name`."""
        return tuple(read(self.nested(f"{name}[{i}]", item)) for i, item in enumerate(items))

    def rest(self) -> dict[str, Any]:
        """The fields not taken yet, taking them."""
        out = {k: v for k, v in self.data.items() if k not in self._taken}
        self._taken.update(out)
        return out

    def finish(self) -> None:
        if not self.strict:
            return
        unknown = sorted(set(self.data) - self._taken)
        if unknown:
            raise self.error(unknown[0], "unknown field")


def _kind(value: Any) -> str:
    names = {dict: "map", list: "array", str: "string", bytes: "binary", memoryview: "binary",
             array: "int32 memfd array"}
    return names.get(type(value), "nil" if value is None else type(value).__name__)


def request_id_of(data: Any) -> int | None:
    """The request id of a wire map when it is a valid one, else None (for error replies)."""
    if type(data) is dict:
        value = data.get("id")
        if type(value) is int and 0 <= value <= MAX_ID:
            return value
    return None
