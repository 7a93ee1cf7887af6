"""Parse and format link bandwidths written the way ``tc`` writes them."""

from __future__ import annotations

import re

__all__ = ["parse_bandwidth", "format_bandwidth", "tbf_burst", "MIN_BANDWIDTH", "MAX_BANDWIDTH"]

# Decimal multipliers, as tc uses them for "kbit", "mbit", ...
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_FORMS = (
    "a number with a unit: bit, kbit, mbit, gbit or tbit (e.g. '100mbit', '1gbit', '2.5gbit', '10Gbit/s')"
)
_PATTERN = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?bit)(?:/s|ps)?", re.IGNORECASE)
# tc reads "bps" as *bytes* per second while people often mean bits: refuse the
# ambiguous spellings rather than silently being off by a factor of eight.
_AMBIGUOUS = re.compile(r".*\d\s*[kmgt]?(bps|b/s|b)", re.IGNORECASE)

MIN_BANDWIDTH = 100 * 10**3
MAX_BANDWIDTH = 100 * 10**9


def parse_bandwidth(value: str | int) -> int:
    """Return the bandwidth *value* ('1gbit', '100mbit', ...) in bits per second."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(f"bandwidth must be a string such as '1gbit', got {value!r}")
    if isinstance(value, int):
        bps = value
    else:
        match = _PATTERN.fullmatch(value.strip())
        if match is None:
            hint = ""
            if _AMBIGUOUS.fullmatch(value.strip()):
                hint = " ('bps'/'b' is ambiguous: tc reads it as bytes; write 'mbit' or 'gbit' for bits)"
            raise ValueError(f"cannot parse bandwidth {value!r}{hint}; expected {_FORMS}")
        bps = round(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if not MIN_BANDWIDTH <= bps <= MAX_BANDWIDTH:
        raise ValueError(
            f"bandwidth {value!r} is {bps} bit/s, outside the supported range "
            f"{format_bandwidth(MIN_BANDWIDTH)} .. {format_bandwidth(MAX_BANDWIDTH)}"
        )
    return bps


def format_bandwidth(bps: int) -> str:
    """Return *bps* in the largest tc unit that writes it exactly ('1gbit', '1500mbit')."""
    for unit, scale in sorted(_UNITS.items(), key=lambda item: -item[1]):
        if bps % scale == 0:
            return f"{bps // scale}{unit}"
    raise ValueError(f"bandwidth must be a whole number of bit/s, got {bps!r}")


def tbf_burst(bps: int) -> int:
    """Return the token-bucket depth (bytes) the lab gives a link of ``bps`` bits per second.

    The bucket must hold at least one GSO super-packet (64 KiB on veth) and about
    1 ms of traffic, or tbf cannot reach the rate with the kernel's timer granularity.
    A link idle long enough starts with it full: that many bytes pass at memory speed.
    """
    return max(64 * 1024, bps // 8 // 1000)
