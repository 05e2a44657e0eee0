"""Kubernetes resource quantities (``500m``, ``16Gi``, ``1e3``) as exact integers. Pure.

A quantity is ``<sign><number><suffix>``: the number is ``12``, ``1.5``, ``.5`` or
``5.``; the suffix one of the binary ``Ki Mi Gi Ti Pi Ei`` (powers of 1024), the
decimal ``n u m "" k M G T P E`` (powers of 1000), or a decimal exponent ``e3`` /
``E-2`` (an integer; ``1e1.5`` is not a quantity). These are the rules of
``resource.ParseQuantity`` (k8s.io/apimachinery), which ``isQuantity()`` in the
CRD's CEL rules applies too.

Values are kept as Kubernetes keeps them: rounded up (away from zero) to a
multiple of 10^-9 and capped at 2^63-1 whole units; ``parse_nanos`` returns that
value in billionths. ``to_units`` turns it into the integer unit kube-scheduler
counts a resource in (``Quantity.MilliValue()`` for cpu, ``Value()`` for every
other resource), rounding up as those do: ``0.1m`` of CPU counts as ``1m``.
"""

from __future__ import annotations

import re

NANO = 10**9
MAX_UNITS = 2**63 - 1  # resource.Quantity's cap, in whole units
MAX_NANOS = MAX_UNITS * NANO

CPU = "cpu"
MEMORY = "memory"
EPHEMERAL_STORAGE = "ephemeral-storage"
PODS = "pods"
HUGEPAGES_PREFIX = "hugepages-"

# The power of ten (decimal) or of two (binary) each suffix multiplies by.
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}

_QUANTITY = re.compile(
    r"(?P<sign>[+-]?)(?P<int>[0-9]*)(?:\.(?P<frac>[0-9]*))?"
    r"(?:(?P<bin>[KMGTPE]i)|[eE](?P<exp>[+-]?[0-9]+)|(?P<dec>[numkMGTPE]?))"
)

_EXPONENT_BOUND = 2**63 - 1  # strconv.ParseInt's int64 range, which an exponent must fit
MAX_LENGTH = 1000  # longer strings are refused (the CRD allows 64; the API server writes ~20)


class QuantityError(ValueError):
    """A string or number that is not a Kubernetes quantity."""


def parse_nanos(raw: str | int) -> int:
    """The value of a quantity in billionths of its unit, as Kubernetes stores it: rounded up
    (away from zero) to a whole billionth and capped at +-(2^63-1) units. An int is a plain
    number. Raises QuantityError for anything else (a float is not a quantity: JSON numbers
    with a fraction are refused by the CRD and never written by the API server)."""
    if isinstance(raw, bool) or not isinstance(raw, int | str):
        raise QuantityError(f"not a quantity: {raw!r}")
    if isinstance(raw, int):
        return max(-MAX_NANOS, min(MAX_NANOS, raw * NANO))
    if len(raw) > MAX_LENGTH:
        raise QuantityError(f"not a quantity: {raw[:40]!r}... ({len(raw)} characters)")
    match = _QUANTITY.fullmatch(raw)
    if match is None or not (match["int"] or match["frac"]):
        raise QuantityError(f"not a quantity: {raw!r}")
    digits = ((match["int"] or "") + (match["frac"] or "")).lstrip("0")
    negative = match["sign"] == "-"
    if not digits:
        return 0
    # value = int(digits) * 10**exponent10 * 2**exponent2
    exponent10 = -len(match["frac"] or "")
    exponent2 = 0
    if match["bin"] is not None:
        exponent2 = _BINARY[match["bin"]]
    elif match["exp"] is not None:
        exponent = int(match["exp"])
        if abs(exponent) > _EXPONENT_BOUND:
            raise QuantityError(f"not a quantity: {raw!r} (exponent out of range)")
        exponent10 += exponent
    else:
        exponent10 += _DECIMAL[match["dec"]]
    nanos = _scaled_up(digits, exponent10 + 9, exponent2)
    return -nanos if negative else nanos


def _scaled_up(digits: str, exponent10: int, exponent2: int) -> int:
    """ceil(int(digits) * 10**exponent10 * 2**exponent2), capped at MAX_NANOS, without ever
    building a number much larger than the cap (``1e999999999`` is a valid quantity)."""
    # 2**exponent2 < 10**19 and MAX_NANOS < 10**28: more than 48 integer digits is over the cap.
    if len(digits) + exponent10 > 48:
        return MAX_NANOS
    if -exponent10 > len(digits) + 19:  # below 10**-19 * 2**60 < 1 billionth: rounds up to one
        return 1
    scale = int(10 ** abs(exponent10))  # at most 10**1019: the string is at most MAX_LENGTH long
    if exponent10 >= 0:
        return min(int(digits) * scale << exponent2, MAX_NANOS)
    return min(-(-(int(digits) << exponent2) // scale), MAX_NANOS)


def to_units(resource: str, nanos: int) -> int:
    """A value in billionths, in the unit kube-scheduler counts ``resource`` in: millicores for
    cpu, whole units (bytes, pods) for the rest, rounded up as ``MilliValue``/``Value`` do."""
    per_unit = NANO // 1000 if resource == CPU else NANO
    return -(-nanos // per_unit)


def parse_units(resource: str, raw: str | int) -> int:
    """A quantity of ``resource`` in the unit kube-scheduler counts it in (see ``to_units``):
    ``parse_units("cpu", "500m") == 500``, ``parse_units("memory", "1Gi") == 2**30``."""
    return to_units(resource, parse_nanos(raw))


def unit_quantity(resource: str, units: int) -> str | int:
    """The quantity a value in ``resource``'s unit is written as: ``500m`` for 500 millicores,
    the plain integer for every other resource. ``parse_units`` reads it back unchanged."""
    return f"{units}m" if resource == CPU else units
