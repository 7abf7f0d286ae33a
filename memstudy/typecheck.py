"""Settings checked against their declared types, whatever way they arrive (TOML, --set, grids).

The type of every setting is the type hint of its dataclass field, read generically, so a field
added later (`image_size: int | str`, `budget: ByteSize | None`) is checked with no extra code:
- bool accepts only true / false (not "yes", not 1); int accepts integers but not booleans;
  float accepts integers too and stores them as floats (TOML `lr = 1`); str only strings;
- `X | Y` accepts what either accepts (in that order, so `int | float` keeps an int an int);
  `None` in a union means "unset"; `list[T]` a list of T; `dict[K, V]` a table;
  `Literal[...]` one of its values.
Ranges and cross-field rules are each config section's own `check`; this module only makes
sure that those checks compare values of the declared type (a string never reaches `lr > 0`).
Torch-free: `import memstudy.config` must stay cheap (the grid parent, reports).
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

from memstudy.errors import ConfigError

_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
          type(None): "unset"}


def field_types(cls: type) -> dict[str, Any]:
    """The resolved type hint of each field of the dataclass `cls`."""
    try:
        return typing.get_type_hints(cls)
    except NameError as exc:  # a hint naming something only imported under TYPE_CHECKING
        raise TypeError(f"{cls.__name__}: field types must be importable at run time ({exc})") \
            from None


def check_fields(obj: Any, prefix: str = "") -> None:
    """Check (and normalise: int -> float) every field of the dataclass `obj`, recursing into
    nested sections; the error names the setting, e.g. `train.lr`."""
    hints = field_types(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_fields(value, f"{key}.")
            continue
        setattr(obj, f.name, typed_value(key, hints[f.name], value))


def typed_value(key: str, hint: Any, value: Any) -> Any:
    """`value` as the declared type `hint`, or a ConfigError naming `key`."""
    ok, converted = _match(hint, value)
    if not ok:
        raise ConfigError(f"{key} must be {describe(hint)} (got {value!r}, "
                          f"{_article(type(value).__name__)})")
    return converted


def describe(hint: Any) -> str:
    """'an integer', 'a number or unset', 'a list of strings', ..."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if origin is list:
        inner = describe(args[0]) if args else "values"
        return f"a list of {_plural(inner)}"
    if origin is dict:
        return "a table of settings"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if hint in _NAMES:
        return _NAMES[hint]
    return _article(getattr(hint, "__name__", str(hint)))


def _match(hint: Any, value: Any) -> tuple[bool, Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True, value
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            ok, converted = _match(arg, value)
            if ok:
                return True, converted
        return False, value
    if origin is Literal:
        return value in args, value
    if origin is list:
        if not isinstance(value, list):
            return False, value
        items = [_match(args[0], v) if args else (True, v) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if origin is dict:
        if not isinstance(value, dict):
            return False, value
        items = {k: _match(args[1], v) if args else (True, v) for k, v in value.items()}
        keys_ok = all(_match(args[0], k)[0] for k in value) if args else True
        return keys_ok and all(ok for ok, _ in items.values()), {k: v for k, (_, v) in items.items()}
    if hint is type(None):
        return value is None, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if isinstance(hint, type):
        return isinstance(value, hint), value
    raise TypeError(f"setting type {hint!r} is not supported by memstudy.typecheck")


def _article(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _plural(phrase: str) -> str:
    for prefix in ("an ", "a "):
        if phrase.startswith(prefix):
            return phrase[len(prefix):] + "s"
    return phrase
