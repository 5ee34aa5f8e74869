"""kvtier.tensorobj: one tensor (or a run of bytes) as one kvtier object, as kvtier.vllm and
kvtier.media store them: a 128-byte header, then the bytes.

Header (little-endian): magic b"KVTEC001" (8 bytes), the object's 16-byte key, the dtype's
torch name NUL-padded to 16 bytes ("bfloat16", "float16", ...; "bytes" for raw bytes: a 1-D
uint8 run), ndim u32 (1 to 4), a zero u32, then 4 u64 dimensions (unused ones 0). A reader
checks the magic, the key it expects and that the shape's bytes fill the object before it
uses a byte: a range that holds anything else is refused, never read as the item.
"""

import struct

import torch

__all__ = ["HEADER_BYTES", "MAX_DIMS", "size_of", "write", "view"]

MAGIC = b"KVTEC001"
HEADER_BYTES = 128
MAX_DIMS = 4
_HDR = struct.Struct("<8s16s16sII4Q")
_ITEMSIZE = {}                   # dtype -> bytes per element, learnt once per dtype


def _itemsize(dtype):
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return size


def _shape(value):
    """(dtype name, shape, bytes) of a tensor; a bytes-like is a 1-D run of "bytes"."""
    if isinstance(value, torch.Tensor):
        return (str(value.dtype).replace("torch.", ""), tuple(value.shape),
                value.numel() * value.element_size())
    n = memoryview(value).nbytes
    return "bytes", (n,), n


def size_of(value):
    """Bytes of the object holding `value` (header included). ValueError when it cannot be
    stored (more than MAX_DIMS dimensions, a dtype name over 16 bytes, a scalar)."""
    name, shape, n = _shape(value)
    if not 1 <= len(shape) <= MAX_DIMS:
        raise ValueError("a tensor of 1 to %d dimensions, not %d" % (MAX_DIMS, len(shape)))
    if len(name.encode("ascii")) > 16:
        raise ValueError("dtype %s cannot be stored" % name)
    return HEADER_BYTES + n


def write(arena, offset, key, value):
    """Writes the object of `value` under `key` at arena[offset:] (size_of(value) bytes): the
    header, then the bytes (from a GPU tensor: one device-to-host copy)."""
    name, shape, n = _shape(value)
    dims = list(shape) + [0] * (MAX_DIMS - len(shape))
    _HDR.pack_into(arena, offset, MAGIC, bytes(key), name.encode("ascii"), len(shape), 0,
                   *dims)
    start = offset + HEADER_BYTES
    if not n:
        return
    if not isinstance(value, torch.Tensor):
        memoryview(arena)[start:start + n] = memoryview(value).cast("B")
        return
    dst = torch.frombuffer(arena, dtype=torch.uint8, count=n, offset=start)
    dst.copy_(value.detach().contiguous().view(-1).view(torch.uint8))


def view(arena, offset, length, key):
    """The value stored at arena[offset:offset+length] under `key`, as a tensor viewing the
    arena (zero-copy; a uint8 tensor for raw bytes), or None when the range does not hold
    that object."""
    if offset < 0 or length < HEADER_BYTES or offset + length > len(arena):
        return None
    magic, got, name, ndim, _, *dims = _HDR.unpack_from(arena, offset)
    name = name.rstrip(b"\0").decode("ascii", "replace")
    dtype = torch.uint8 if name == "bytes" else getattr(torch, name, None)
    if magic != MAGIC or got != bytes(key) or not isinstance(dtype, torch.dtype) or \
            not 1 <= ndim <= MAX_DIMS:
        return None
    shape = tuple(dims[:ndim])
    count = 1
    for d in shape:
        count *= d
    n = count * _itemsize(dtype)
    if HEADER_BYTES + n != length:
        return None
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(arena, dtype=torch.uint8, count=n, offset=offset + HEADER_BYTES)
    return flat.view(dtype).view(shape)
