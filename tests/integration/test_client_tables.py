"""The Python client's request numbers and error classes against the daemon's two X-macro
tables, read from the headers' text: KVT_REQ_MAP (protocol/kvt_proto.h) and KVT_ERRNO_MAP
(common/kvt_error.h). Every row both ways: each wire id has its constant in kvtier (same
name, same number, exported) and each constant of kvtier names a row; each wire error code
has its exception class (kvtier.error_for gives it, with .code) and each daemon-side class
of kvtier.errors has a wire code of the table. The header parse is strict and fails loudly
when it finds fewer rows than the tables have. Needs no daemon (the C side of the same check
is tests/unit/test_client_codes.c)."""

import os
import re

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.join(_HERE, "..", "..")

import kvtier  # noqa: E402
from kvtier import errors  # noqa: E402

# The client's own codes, never sent by the daemon.
CLIENT_ONLY = {"timeout", "protocol"}
# At least this many rows (the tables are append-only: they only grow).
MIN_REQ_ROWS = 19
MIN_ERR_ROWS = 16


def _macro_body(path, macro):
    """The text of `#define macro(XX) ...` up to its last continuation line."""
    with open(os.path.join(_ROOT, path)) as f:
        lines = f.read().split("\n")
    start = [i for i, l in enumerate(lines) if l.startswith("#define %s(XX)" % macro)]
    assert len(start) == 1, "%s: %d definitions of %s" % (path, len(start), macro)
    body = []
    for line in lines[start[0]:]:
        body.append(line.rstrip("\\").rstrip())
        if not line.rstrip().endswith("\\"):
            break
    return " ".join(body)


def _rows(path, macro, row_re, minimum):
    body = _macro_body(path, macro)
    rows = re.findall(row_re, body)
    # every XX( of the body must be one parsed row: a row the regex misses fails here
    assert body.count("XX(") == len(rows), \
        "%s: %d XX( rows, %d parsed by the regex" % (macro, body.count("XX("), len(rows))
    assert len(rows) >= minimum, "%s: only %d rows parsed" % (macro, len(rows))
    return rows


def req_map():
    """{NAME: id} of KVT_REQ_MAP; also checks the lower-case wire name matches NAME."""
    rows = _rows("protocol/kvt_proto.h", "KVT_REQ_MAP",
                 r'XX\(\s*(\d+)\s*,\s*([A-Z][A-Z0-9_]*)\s*,\s*"([a-z0-9_]+)"\s*,', MIN_REQ_ROWS)
    out = {}
    for num, name, wire in rows:
        assert wire == name.lower(), "row %s: wire name %s" % (name, wire)
        assert name not in out, "duplicate row %s" % name
        out[name] = int(num)
    assert len(set(out.values())) == len(out), "duplicate request ids"
    return out


def errno_map():
    """[(NAME, number, wire code)] of KVT_ERRNO_MAP."""
    rows = _rows("common/kvt_error.h", "KVT_ERRNO_MAP",
                 r'XX\(\s*([A-Z][A-Z0-9_]*)\s*,\s*(-\d+)\s*,\s*"([a-z_]+)"\s*,', MIN_ERR_ROWS)
    out = [(name, int(num), wire) for name, num, wire in rows]
    assert len({n for _, n, _ in out}) == len(out), "duplicate error numbers"
    return out


def test_request_ids_match_kvt_req_map():
    table = req_map()
    for name, num in table.items():
        assert hasattr(kvtier, name), "kvtier has no constant %s (wire id %d)" % (name, num)
        assert getattr(kvtier, name) == num, \
            "kvtier.%s = %r, KVT_REQ_MAP says %d" % (name, getattr(kvtier, name), num)
        assert name in kvtier.__all__, "kvtier.%s is not exported" % name
    # ... and back: every request constant of the client is a row (ids 1.. as ints)
    client = {n: getattr(kvtier.client, n) for n in dir(kvtier.client)
              if re.fullmatch(r"[A-Z][A-Z0-9_]*", n) and n != "PROTO_VERSION"
              and isinstance(getattr(kvtier.client, n), int)}
    assert client, "no request constants found in kvtier.client"
    for name, num in client.items():
        assert table.get(name) == num, "kvtier.client.%s = %d is no KVT_REQ_MAP row" % (name, num)


def test_wire_errors_match_kvt_errno_map():
    rows = errno_map()
    wires = {w for _, _, w in rows}
    for name, num, wire in rows:
        e = kvtier.error_for(wire, "m", 4)
        assert type(e) is not kvtier.KvtierError, \
            "wire code %s (KVT_E%s = %d) has no exception class" % (wire, name, num)
        assert isinstance(e, kvtier.KvtierError)
        assert e.code == wire and type(e).code == wire and e.message == "m" and e.type == 4
        assert type(e).__name__ in kvtier.__all__, "%s is not exported" % type(e).__name__
    # ... and back: every class of the mapping answers a code of the table or is the client's
    classes = [c for c in vars(errors).values()
               if isinstance(c, type) and issubclass(c, kvtier.KvtierError)
               and c is not kvtier.KvtierError]
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes)), "two classes share a code"
    for c in classes:
        assert c.code in wires or c.code in CLIENT_ONLY, \
            "%s.code %r is no wire code of KVT_ERRNO_MAP" % (c.__name__, c.code)
        assert errors.error_for(c.code).__class__ is c
    assert set(codes) == wires | CLIENT_ONLY
    assert not (wires & CLIENT_ONLY), "a client-only code became a wire code"
    # a code this version does not know is the base class
    assert type(kvtier.error_for("no_such_code")) is kvtier.KvtierError


def test_the_parser_reads_the_rows_it_should():
    """The parse itself: rows the tests above rely on, at their frozen numbers."""
    t = req_map()
    assert t["HELLO"] == 1 and t["PUT"] == 10 and t["RETRIEVE_GPU"] == 19
    e = {n: (num, w) for n, num, w in errno_map()}
    assert e["BADREQ"] == (-1, "bad_request") and e["NOINST"] == (-16, "instance_dropped")
