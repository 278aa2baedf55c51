"""Typed reads of an HF ``config.json``: every value is checked as a TOML value is, so a
``"hidden_size": "128"`` or a ``NaN`` is one error naming the file and field, not a
``TypeError`` deep in the model or a silent cast."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

_REQUIRED: Any = object()
_ABSENT: Any = object()


class ConfigFields:
    """The fields of one HF config dict read by type; a wrong one raises ``error(message)``.

    The rule is transformers': a field that is absent or JSON ``null`` takes the default
    transformers takes for it, given here as ``default`` and returned as it is, unchecked
    (``head_dim`` absent: ``None``, for the caller to derive). Released config.json files write
    ``null`` for many optional fields (``rope_scaling``, ``sliding_window``, ``bos_token_id``,
    ``pad_token_id``, ``layer_types``), so ``null`` never means "refuse". Only a field without
    a default (a shape field, where transformers' default describes some other model) is
    required. A value that is present is checked: the type, and the range the model needs.
    """

    def __init__(self, config: Mapping[str, Any], source: str, error: type[Exception]) -> None:
        self.config, self.source, self.error = config, source, error

    def _given(self, name: str, default: Any) -> Any:
        """The file's value of ``name``; ``_ABSENT`` when absent or null and ``default`` is given."""
        value = self.config.get(name)
        if value is not None:
            return value
        if default is _REQUIRED:
            raise self.error(f"{self.source}: required field '{name}' is missing")
        return _ABSENT

    def _refuse(self, name: str, value: Any, wanted: str) -> Exception:
        return self.error(f"{self.source}: {name}={value!r} must be {wanted}; fix the file or re-download it")

    def int(self, name: str, default: Any = _REQUIRED, minimum: int = 1) -> Any:
        """An integer >= ``minimum`` (JSON ``128``, not ``"128"``, ``128.0`` or ``true``)."""
        value = self._given(name, default)
        if value is _ABSENT:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self._refuse(name, value, f"an integer >= {minimum}")
        return value

    def float(self, name: str, default: Any = _REQUIRED, zero_ok: bool = False) -> Any:
        """A finite number > 0 (>= 0 when ``zero_ok``): JSON ``1e-6`` or ``1000000``; not
        ``NaN``, ``Infinity`` or ``"1e-6"``."""
        value = self._given(name, default)
        if value is _ABSENT:
            return default
        wanted = f"a finite number {'>=' if zero_ok else '>'} 0"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self._refuse(name, value, wanted)
        if value < 0 or (value == 0 and not zero_ok):
            raise self._refuse(name, value, wanted)
        return float(value)

    def bool(self, name: str, default: bool = False) -> bool:
        """``true`` or ``false`` (not ``"false"``, which would read as true)."""
        return self._typed(name, default, bool, "true or false")

    def str(self, name: str, default: Any = _REQUIRED) -> Any:
        """A string (``"silu"``)."""
        return self._typed(name, default, str, "a string")

    def ints(self, name: str) -> tuple[int, ...]:
        """A list of integers >= 0 (layer indices), empty when absent."""
        value = self._given(name, [])
        if value is _ABSENT:
            return ()
        if not isinstance(value, list) or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value
        ):
            raise self._refuse(name, value, "a list of integers >= 0")
        return tuple(value)

    def mapping(self, name: str) -> Mapping[str, Any]:
        """An object (``{}`` when absent)."""
        return self._typed(name, {}, Mapping, "an object")

    def _typed(self, name: str, default: Any, kind: type, wanted: str) -> Any:
        """The file's ``name`` when it is a ``kind``; ``default`` when absent or null."""
        value = self._given(name, default)
        if value is _ABSENT:
            return default
        if not isinstance(value, kind):
            raise self._refuse(name, value, wanted)
        return value
