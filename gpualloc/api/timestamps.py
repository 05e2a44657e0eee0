"""The API's timestamps (metav1.Time and MicroTime) as text and back. Pure."""

from __future__ import annotations

import datetime


def format_time(when: datetime.datetime) -> str:
    """RFC 3339 in UTC with a ``Z``, second precision (the API's ``Time``)."""
    return when.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> datetime.datetime | None:
    """An API timestamp (``Time`` or ``MicroTime``) as an aware datetime; None if absent or malformed."""
    if not text:
        return None
    try:
        when = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=datetime.UTC)
