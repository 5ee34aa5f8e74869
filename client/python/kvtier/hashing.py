"""Chunk keys of a token sequence, computed locally exactly as the daemon's HASH_TOKENS does
(protocol/kvt_hash.h):

    prev  = 16 zero bytes                  (no salt)
          = xxh3_128(salt utf-8)           (salt)
    key_i = xxh3_128(prev || chunk_i)      chunk_i: chunk_tokens tokens as LE uint32 bytes
    prev  = key_i

Digests are the canonical (big-endian) 16-byte form. A trailing partial chunk gets no key.
Each key depends on every token before it, so equal keys mean equal prefixes.

Needs the `xxhash` module (Debian: python3-xxhash); without it `hash_tokens` raises
Unavailable and `Client.chunk_keys` asks the daemon instead.
"""

import array
import hashlib
import sys

from .errors import BadRequest, Unavailable

try:
    import xxhash as _xxhash
    _xxh3_128 = _xxhash.xxh3_128_digest
except (ImportError, AttributeError):   # missing, or too old for XXH3
    _xxh3_128 = None

__all__ = ["have_xxhash", "hash_tokens", "token_bytes", "xxh3_128", "name_key", "label_of"]

MAX_LABEL = 255          # bytes of a RESERVE/PUT label (UTF-8)

KEY_LEN = 16


def name_key(name):
    """The 16-byte key of an object known by a name (an embedding's mm_hash, a media hash):
    BLAKE2b-128 of its UTF-8. kvtier.vllm and kvtier.media key their objects so, and a
    coordinator can compute the key of a name it was told about."""
    if isinstance(name, str):
        name = name.encode("utf-8")
    return hashlib.blake2b(bytes(name), digest_size=16).digest()


def label_of(name):
    """`name` as an object label (RESERVE/PUT `labels`, carried by the object's events):
    the str itself when it is one of at most MAX_LABEL UTF-8 bytes, else None (no label)."""
    if isinstance(name, (bytes, bytearray, memoryview)):
        try:
            name = bytes(name).decode("utf-8")
        except UnicodeDecodeError:
            return None
    if not isinstance(name, str) or len(name.encode("utf-8", "surrogatepass")) > MAX_LABEL:
        return None
    try:
        name.encode("utf-8")                   # lone surrogates are not UTF-8
    except UnicodeEncodeError:
        return None
    return name


def have_xxhash():
    """True when keys can be computed locally (the xxhash module with XXH3 is installed)."""
    return _xxh3_128 is not None


def xxh3_128(data):
    """The 16-byte canonical XXH3-128 digest (seed 0) of `data` — e.g. the key of a multimodal
    object from its media bytes."""
    if _xxh3_128 is None:
        raise Unavailable("the xxhash module (python3-xxhash) is not installed")
    return _xxh3_128(data)


def token_bytes(tokens, check=True):
    """Tokens as the wire wants them: little-endian uint32 bytes. `tokens` is bytes-like
    (taken as already encoded; with check, its length must be a multiple of 4), an array with
    a numpy-like `astype`, or a sequence of ints in [0, 2**32)."""
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        b = bytes(tokens)
        if check and len(b) % 4:
            raise BadRequest("tokens: %d bytes is not a multiple of 4" % len(b))
        return b
    if hasattr(tokens, "astype") and hasattr(tokens, "tobytes"):       # numpy, without importing it
        return tokens.astype("<u4").tobytes()
    try:
        a = array.array("I", tokens)
    except (OverflowError, TypeError) as e:
        raise BadRequest("tokens: %s (need ints in [0, 2**32))" % e) from None
    if a.itemsize != 4:                         # not on any platform we run on, but be exact
        return b"".join(int(t).to_bytes(4, "little") for t in a)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def _salt_bytes(salt):
    if salt is None:
        return b""
    return salt.encode("utf-8") if isinstance(salt, str) else bytes(salt)


def hash_tokens(tokens, chunk_tokens, salt=None):
    """The keys (list of 16-byte bytes) of the full chunks of `tokens`, locally. Same answer
    as the daemon's HASH_TOKENS with the same chunk_tokens and salt."""
    if _xxh3_128 is None:
        raise Unavailable("the xxhash module (python3-xxhash) is not installed; "
                          "use Client.hash_tokens to ask the daemon")
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens <= 0:
        raise BadRequest("chunk_tokens must be a positive int, not %r" % (chunk_tokens,))
    data = token_bytes(tokens)
    s = _salt_bytes(salt)
    prev = _xxh3_128(s) if s else bytes(KEY_LEN)
    step = chunk_tokens * 4
    mv = memoryview(data)
    keys = []
    for off in range(0, len(data) - step + 1, step):
        prev = _xxh3_128(prev + mv[off:off + step])
        keys.append(prev)
    return keys
