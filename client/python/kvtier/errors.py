"""Typed errors: one exception class per wire error code, all under KvtierError.

A failed reply `{ok: false, error: {code, message}}` is raised as the subclass for `code`
(`except kvtier.NoSpace:`), or as KvtierError itself for a code this version does not know;
either way `.code` is the wire code and `.message` the daemon's sentence. Two codes are the
client's own and never come from the daemon: `timeout` (no reply within timeout_ms) and
`protocol` (a reply this client cannot decode).
"""

__all__ = [
    "KvtierError", "BadRequest", "UnknownType", "UnsupportedVersion", "TooLarge", "NoSpace",
    "NotFound", "LeaseExpired", "UnknownLease", "Busy", "Internal", "Unavailable",
    "InstanceDropped", "Timeout", "ProtocolError", "error_for",
]


class KvtierError(Exception):
    """An error answered by the daemon (or detected by the client). `.code` is the wire code
    ("no_space", "bad_request", ...), `.message` the human sentence, `.type` the request type
    number that failed (None when not tied to one)."""

    code = None

    def __init__(self, code, message="", type=None):  # noqa: A002 - mirrors the wire field
        super().__init__(code, message)
        self.code = code
        self.message = message
        self.type = type

    def __str__(self):
        return "%s: %s" % (self.code, self.message) if self.message else str(self.code)


def _subclass(name, code, doc):
    cls = type(name, (KvtierError,), {"__doc__": doc, "code": code})

    def __init__(self, message="", type=None, code=code):  # noqa: A002
        KvtierError.__init__(self, code, message, type)
    cls.__init__ = __init__
    return cls


BadRequest = _subclass("BadRequest", "bad_request", "A malformed request or a field out of bounds.")
UnknownType = _subclass("UnknownType", "unknown_type", "The request type is not in the table.")
UnsupportedVersion = _subclass("UnsupportedVersion", "unsupported_version",
                               "HELLO asked for a protocol version the daemon does not speak.")
TooLarge = _subclass("TooLarge", "too_large",
                     "Over max_message, a body bound, or max_keys.")
NoSpace = _subclass("NoSpace", "no_space", "RESERVE: not even the first key fits in L1.")
NotFound = _subclass("NotFound", "not_found", "The object or job does not exist.")
LeaseExpired = _subclass("LeaseExpired", "lease_expired",
                         "The lease was lost: its instance was silent for longer than lease_ms.")
UnknownLease = _subclass("UnknownLease", "unknown_lease",
                         "No such lease for this instance (never existed, or already ended).")
Busy = _subclass("Busy", "busy", "The daemon is overloaded; retry later.")
Internal = _subclass("Internal", "internal", "A bug or an allocation failure in the daemon.")
Unavailable = _subclass("Unavailable", "unavailable",
                        "Valid, but not available here (daemon version, or no arena mapping).")
InstanceDropped = _subclass(
    "InstanceDropped", "instance_dropped",
    "This connection acts for no client instance: it was dropped (silent for longer than "
    "lease_ms) or the daemon restarted. Client.call() says HELLO again and retries by itself, "
    "so it reaches the caller only from calls that are not retried, or from send()/recv().")
Timeout = _subclass("Timeout", "timeout", "Client side: no reply within timeout_ms.")
ProtocolError = _subclass("ProtocolError", "protocol",
                          "Client side: a reply that does not follow protocol v1.")

_BY_CODE = {c.code: c for c in (BadRequest, UnknownType, UnsupportedVersion, TooLarge, NoSpace,
                                NotFound, LeaseExpired, UnknownLease, Busy, Internal, Unavailable,
                                InstanceDropped, Timeout, ProtocolError)}


def error_for(code, message="", type=None):  # noqa: A002
    """The exception instance for a wire error code (KvtierError for an unknown code)."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return KvtierError(code, message, type)
    return cls(message, type)
