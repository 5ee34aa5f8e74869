"""CURVE for tcp:// connections to a kvtierd configured with curve.server_cert.

Certificates are czmq's zcert text format, as `kvtier keygen PATH` writes them: PATH holds
`public-key = "..."`, PATH_secret holds both keys (40 Z85 characters each). The same rules as
libkvtier: a server key is Z85 text or a certificate path; a client certificate is PATH (the
secret half read from PATH_secret). Environment defaults: KVTIER_CURVE_SERVERKEY and
KVTIER_CURVE_CERT.
"""

import os
import re

import zmq
from zmq.utils import z85

_LINE = re.compile(r"""^\s*(public-key|secret-key)\s*=\s*["']?([^"'\s]{40})""", re.M)


def _is_z85(text):
    try:
        return len(text) == 40 and len(z85.decode(text)) == 32
    except Exception:  # noqa: BLE001 - any decode failure means "not a key"
        return False


def load_cert(path, want_secret=False):
    """(public, secret or None) as Z85 bytes from a zcert file (PATH_secret first)."""
    text = None
    for p in (path + "_secret", path):
        try:
            with open(p, "r", encoding="ascii", errors="replace") as f:
                text = f.read(65536)
            break
        except OSError:
            continue
    if text is None:
        raise ValueError("cannot read the certificate %s" % path)
    keys = {k: v for k, v in _LINE.findall(text) if _is_z85(v)}
    if "public-key" not in keys or (want_secret and "secret-key" not in keys):
        raise ValueError("%s is not a zcert %scertificate" % (path, "secret " if want_secret
                                                               else ""))
    sec = keys.get("secret-key")
    return keys["public-key"].encode(), sec.encode() if sec else None


def apply(sock, endpoint, server_key=None, client_cert=None):
    """Makes sock a CURVE client for a tcp:// endpoint; returns True when it did."""
    server_key = server_key or os.environ.get("KVTIER_CURVE_SERVERKEY")
    client_cert = client_cert or os.environ.get("KVTIER_CURVE_CERT")
    if not endpoint.startswith("tcp://") or not server_key:
        return False
    skey = server_key.encode() if _is_z85(server_key) else load_cert(server_key)[0]
    if client_cert:
        pub, sec = load_cert(client_cert, want_secret=True)
    else:
        pub, sec = zmq.curve_keypair()      # only a daemon accepting any key answers
    sock.curve_serverkey = skey
    sock.curve_publickey = pub
    sock.curve_secretkey = sec
    return True
