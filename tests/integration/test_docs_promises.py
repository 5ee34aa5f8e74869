"""docs/operations.md ("What kvtier promises") names the tests behind every promise; this keeps
those names true: each `file::test` it cites exists, and each cited file exists."""

import os
import re

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _promise_table():
    with open(os.path.join(_ROOT, "docs", "operations.md")) as f:
        text = f.read()
    start = text.index("## What kvtier promises")
    end = text.index("### Limits every request is held to", start)
    return text[start:end]


def _resolve(path):
    for cand in (path, os.path.join("tests", "integration", path)):
        if os.path.isfile(os.path.join(_ROOT, cand)):
            return os.path.join(_ROOT, cand)
    raise AssertionError("docs/operations.md cites %s, which does not exist" % path)


def test_every_cited_test_exists():
    table = _promise_table()
    rows = [l for l in table.splitlines() if l.startswith("| ") and "---" not in l][1:]
    assert len(rows) >= 10, rows
    cited = 0
    for row in rows:
        checked_by = row.rstrip(" |").rsplit(" | ", 1)[-1]
        current = None
        for item in re.split(r";\s*|,\s*", checked_by):
            item = item.strip()
            m = re.match(r"([\w/.]+\.(?:py|c))(?:::(\w+))?", item)
            if m:
                current = _resolve(m.group(1))
                names = [m.group(2)] if m.group(2) else []
            else:
                m = re.match(r"::(\w+)", item)
                names = [m.group(1)] if m else []
            for name in names:
                assert current, "test %s cited without a file in: %s" % (name, row)
                with open(current) as f:
                    src = f.read()
                assert re.search(r"(def|void) %s\(" % name, src), \
                    "docs/operations.md cites %s::%s, which does not exist" % (
                        os.path.relpath(current, _ROOT), name)
                cited += 1
    assert cited >= 40, cited
