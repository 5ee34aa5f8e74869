"""The version comes from the repository's VERSION file, the one the daemon's build reads
(Makefile). Building from the source tree writes it into kvtier/_version.py, which an sdist
carries, so a build from an sdist (no VERSION file beside it) reads it from there.

The fast path's ring code (libkvtier's kvtier_ring_* calls: client/kvtier_ring.c over
common/kvt_ring.c, nothing but libc; and kvtier_resident_prefix over common/kvt_resident.c,
which also needs the xxhash.h header) is built into the package as kvtier/_kvtring*.so, which
kvtier._ring loads with ctypes: `pip install ./client/python` alone gives the fast path,
without libkvtier installed. The C files are copied into csrc/ from the source tree (an sdist
carries them). Optional: without a C compiler the install still succeeds, without the fast
path (kvtier.Client.fastpath_why then says why)."""

import os
import re
import shutil

from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.join(HERE, "..", "..")
REPO_VERSION = os.path.join(REPO, "VERSION")
VERSION_PY = os.path.join(HERE, "kvtier", "_version.py")
CSRC = os.path.join(HERE, "csrc")
RING_FILES = ["client/kvtier_ring.c", "client/kvtier.h", "common/kvt_ring.c",
              "common/kvt_ring.h", "common/kvt_error.c", "common/kvt_error.h",
              "common/kvt_resident.c", "common/kvt_resident.h", "common/kvt_key.h"]


def _ring_sources():
    """The ring's C files in csrc/ (refreshed from the source tree when there is one)."""
    if all(os.path.exists(os.path.join(REPO, f)) for f in RING_FILES):
        os.makedirs(CSRC, exist_ok=True)
        for f in RING_FILES:
            src, dst = os.path.join(REPO, f), os.path.join(CSRC, os.path.basename(f))
            if not os.path.exists(dst) or open(src, "rb").read() != open(dst, "rb").read():
                shutil.copyfile(src, dst)
    srcs = [os.path.join("csrc", os.path.basename(f)) for f in RING_FILES if f.endswith(".c")]
    return srcs if _have_xxhash() else [f for f in srcs if not f.endswith("kvt_resident.c")]


def _have_xxhash():
    """Whether xxhash.h 0.8 or later (Debian: libxxhash-dev) is there: the residency map's tags
    are XXH3, stable from 0.8 on (inlined from the header, no library to link). Without it the
    ring builds alone, with no residency map."""
    dirs = ["/usr/include", "/usr/local/include"]
    dirs += [d for v in ("CPATH", "C_INCLUDE_PATH") for d in os.environ.get(v, "").split(":") if d]
    for d in dirs:
        try:
            with open(os.path.join(d, "xxhash.h"), encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        ver = [re.search(r"#\s*define\s+XXH_VERSION_%s\s+(\d+)" % p, text)
               for p in ("MAJOR", "MINOR")]
        return all(ver) and (int(ver[0].group(1)), int(ver[1].group(1))) >= (0, 8)
    return False


def _version():
    if os.path.exists(REPO_VERSION):
        with open(REPO_VERSION, encoding="ascii") as f:
            version = f.read().strip()
        text = '# written by setup.py from the repository\'s VERSION file\n' \
               '__version__ = "%s"\n' % version
        old = None
        if os.path.exists(VERSION_PY):
            with open(VERSION_PY, encoding="ascii") as f:
                old = f.read()
        if old != text:
            with open(VERSION_PY, "w", encoding="ascii") as f:
                f.write(text)
        return version
    with open(VERSION_PY, encoding="ascii") as f:
        m = re.search(r'__version__ = "([^"]+)"', f.read())
    if not m:
        raise RuntimeError("no version: neither ../../VERSION nor kvtier/_version.py")
    return m.group(1)


# A shared object loaded with ctypes, not a Python module (it defines no PyInit_): setuptools
# builds it with the compiler and flags it uses for extensions.
RING = Extension("kvtier._kvtring", sources=_ring_sources(), include_dirs=["csrc"],
                 define_macros=[("_GNU_SOURCE", None)] + ([] if _have_xxhash() else
                                                          [("KVT_NO_RESIDENT", None)]),
                 extra_compile_args=["-std=gnu11", "-O2", "-fvisibility=default"],
                 optional=True)

setup(version=_version(), ext_modules=[RING])
