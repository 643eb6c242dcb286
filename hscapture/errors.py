"""The exception family for protocol and store faults.

Caller mistakes (a bad argument, a bad config value) raise builtin ``ValueError`` or
``TypeError``; everything that goes wrong between the processes or on disk raises a subclass
of ``HSCaptureError`` whose message names the field or slot, the bad value and the fix.
"""


class HSCaptureError(Exception):
    """Base of every fault hscapture raises outside plain argument checks."""


class ProtocolError(HSCaptureError):
    """A message on the wire was malformed, of another protocol version, or out of range."""


class StoreError(HSCaptureError):
    """A store on disk is missing, torn, or inconsistent with its index."""


class CreditTimeout(HSCaptureError):
    """``block`` policy waited longer than ``block_timeout_s`` for a free ring slot."""


class AccessError(HSCaptureError):
    """A path or peer this user cannot trust: a socket directory or token file of another user or open
    to others, a planted link, a key the other side refused, or a second consumer where one is attached."""


def short_repr(value: object, limit: int = 80) -> str:
    """Peer-supplied values in messages and logs, cut short so a hostile peer cannot flood a log."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} chars)"
