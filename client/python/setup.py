"""The version comes from the repository's VERSION file, the one the daemon's build reads
(Makefile). Building from the source tree writes it into kvtier/_version.py, which an sdist
carries, so a build from an sdist (no VERSION file beside it) reads it from there."""

import os
import re

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_VERSION = os.path.join(HERE, "..", "..", "VERSION")
VERSION_PY = os.path.join(HERE, "kvtier", "_version.py")


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


setup(version=_version())
