"""contrib/: the Prometheus rules and the Grafana dashboard against a live daemon.

Every metric that a rule's expr or a dashboard query names must exist in the /metrics of a
running kvtierd (with an L2 adapter and the LMCache endpoint, so that every family is there),
histograms under the suffixed name the query uses (`_bucket`, `_sum`, `_count`); every label a
matcher or a by/without/on/ignoring clause names must exist on those metrics, and every value
an `=` matcher (or a regex that is an alternation of plain words) asks for must be one the
daemon exports. Recording-rule names (`kvtier:...`) must be defined in the rules file. A rename
in the daemon therefore fails here instead of silently emptying a panel or muting an alert.
The PromQL reading below is a small lexer, enough for these files, not a full parser.

Also: the dashboard's structure (unique ids, datasource variable, units, a grid without
overlaps), each alert's labels and annotations, its runbook anchor in docs/operations.md, its
row in the docs' table and its firing case in tests/prometheus/kvtier-rules.test.yml.
promtool's own checks are `make check-contrib`.
"""

import json
import os
import re

import pytest

from kvtest import parse_metrics

try:
    import yaml
except ImportError:  # python3-yaml is in the Makefile's DEB_PY_PKGS
    yaml = None

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RULES = os.path.join(_REPO, "contrib", "prometheus", "kvtier-rules.yml")
RULES_TEST = os.path.join(_REPO, "tests", "prometheus", "kvtier-rules.test.yml")
DASHBOARD = os.path.join(_REPO, "contrib", "grafana", "kvtier.json")
OPERATIONS = os.path.join(_REPO, "docs", "operations.md")

# Metrics that are not the daemon's: Prometheus' own per-target series.
ALLOWED_METRICS = {"up"}
# Labels Prometheus adds to every scraped series (the scrape config's target labels).
TARGET_LABELS = {"job", "instance"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
# Aggregation operators: `sum by (l) (x)` puts a keyword, not "(", after the name.
AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count",
                "count_values", "bottomk", "topk", "quantile"}

pytestmark = pytest.mark.skipif(yaml is None, reason="python3-yaml is not installed")


# ---- a PromQL lexer, enough for our files -------------------------------------------------

def _lex(expr):
    """Tokens of `expr` as (kind, text): ident, string, number, op, punct. Range and subquery
    brackets ([5m], [1h:1m]) and comments are dropped."""
    toks = []
    i, n = 0, len(expr)
    while i < n:
        c = expr[i]
        if c.isspace():
            i += 1
        elif c == "#":
            while i < n and expr[i] != "\n":
                i += 1
        elif c in "\"'`":
            j = i + 1
            while j < n and expr[j] != c:
                j += 2 if expr[j] == "\\" and c != "`" else 1
            if j >= n:
                raise ValueError("unterminated string in %r" % expr)
            raw = expr[i + 1:j]
            toks.append(("string", raw if c == "`" else
                         raw.encode().decode("unicode_escape")))
            i = j + 1
        elif c == "[":
            j = expr.index("]", i)
            i = j + 1
        elif c.isdigit() or (c == "." and i + 1 < n and expr[i + 1].isdigit()):
            j = i
            while j < n and (expr[j].isalnum() or expr[j] == "."):
                j += 1
            toks.append(("number", expr[i:j]))
            i = j
        elif c.isalpha() or c in "_:":
            j = i
            while j < n and (expr[j].isalnum() or expr[j] in "_:"):
                j += 1
            toks.append(("ident", expr[i:j]))
            i = j
        elif expr[i:i + 2] in ("=~", "!~", "!=", "==", ">=", "<="):
            toks.append(("op", expr[i:i + 2]))
            i += 2
        else:
            toks.append(("punct" if c in "(){}," else "op", c))
            i += 1
    return toks


def _close(toks, k):
    """Index of the token closing the bracket at toks[k] ('(' or '{')."""
    opening = toks[k][1]
    closing = {"(": ")", "{": "}"}[opening]
    depth = 0
    for j in range(k, len(toks)):
        if toks[j] == ("punct", opening):
            depth += 1
        elif toks[j] == ("punct", closing):
            depth -= 1
            if depth == 0:
                return j
    raise ValueError("unbalanced %r" % opening)


def _open(toks, k):
    """Index of the '(' that the ')' at toks[k] closes."""
    depth = 0
    for j in range(k, -1, -1):
        if toks[j] == ("punct", ")"):
            depth += 1
        elif toks[j] == ("punct", "("):
            depth -= 1
            if depth == 0:
                return j
    raise ValueError("unbalanced ')'")


def parse_promql(expr):
    """Returns (selectors, groupings): selectors are (index, metric, [(label, op, value)]),
    groupings are (keyword, [labels], first, last) where first..last is the token range whose
    metrics the labels must be found on."""
    toks = _lex(expr)
    selectors, groupings = [], []
    k = 0
    while k < len(toks):
        kind, text = toks[k]
        nxt = toks[k + 1] if k + 1 < len(toks) else None
        if kind == "ident" and text in GROUPING:
            if nxt != ("punct", "("):  # group_left with no label list
                k += 1
                continue
            end = _close(toks, k + 1)
            labels = [t for kd, t in toks[k + 2:end] if kd == "ident"]
            if text in ("by", "without"):
                if k > 0 and toks[k - 1] == ("punct", ")"):  # sum (x) by (l)
                    first, last = _open(toks, k - 1), k - 1
                elif end + 1 < len(toks) and toks[end + 1] == ("punct", "("):  # sum by (l) (x)
                    first, last = end + 1, _close(toks, end + 1)
                else:
                    raise ValueError("cannot find what %s (...) groups in %r" % (text, expr))
            else:  # on/ignoring/group_*: either side of the binary operator
                first, last = 0, len(toks) - 1
            groupings.append((text, labels, first, last))
            k = end + 1
        elif kind == "ident" and (text.lower() in KEYWORDS or text in AGGREGATIONS):
            k += 1
        elif kind == "ident" and nxt == ("punct", "("):  # function or aggregation
            k += 1
        elif kind == "ident":
            matchers = []
            j = k + 1
            if nxt == ("punct", "{"):
                j = _close(toks, k + 1)
                body = [t for t in toks[k + 2:j] if t != ("punct", ",")]
                if len(body) % 3:
                    raise ValueError("cannot read the matchers of %s in %r" % (text, expr))
                for m in range(0, len(body), 3):
                    (lk, label), (ok, op), (vk, value) = body[m:m + 3]
                    if lk != "ident" or ok != "op" or vk != "string":
                        raise ValueError("cannot read the matchers of %s in %r" % (text, expr))
                    matchers.append((label, op, value))
                j += 1
            selectors.append((k, text, matchers))
            k = j
        elif (kind, text) == ("punct", "{"):
            raise ValueError("a selector without a metric name in %r" % expr)
        else:
            k += 1
    return selectors, groupings


# ---- the check ----------------------------------------------------------------------------

def exported(samples):
    """{sample name: {label: set(values)}} from parsed /metrics samples."""
    out = {}
    for s in samples:
        labels = out.setdefault(s.name, {})
        for k, v in s.labels.items():
            labels.setdefault(k, set()).add(v)
    return out


def _literal_words(regex):
    """The words of a regex that is a plain alternation (a|b|c), else None."""
    return regex.split("|") if re.fullmatch(r"[A-Za-z0-9_]+(\|[A-Za-z0-9_]+)*", regex) else None


def check_expr(where, expr, metrics, recorded):
    """Problems (strings) with one PromQL expression: names not exported by the daemon (or
    recorded by the rules), labels not on the metrics they are used with, matcher values no
    sample has. `metrics` is exported()'s map, `recorded` the recording-rule names."""
    problems = []
    try:
        selectors, groupings = parse_promql(expr)
    except ValueError as e:
        return ["%s: %s" % (where, e)]
    if not selectors:
        problems.append("%s: names no metric: %r" % (where, expr))
    for _, name, matchers in selectors:
        if ":" in name:
            if name not in recorded:
                problems.append("%s: %s is not a recording rule of %s" %
                                (where, name, os.path.relpath(RULES, _REPO)))
            continue
        if name in ALLOWED_METRICS:
            continue
        if not name.startswith("kvtier_"):
            problems.append("%s: %s is not a kvtier_* metric" % (where, name))
            continue
        if name not in metrics:
            problems.append("%s: %s is not in the daemon's /metrics" % (where, name))
            continue
        for label, op, value in matchers:
            if label in TARGET_LABELS:
                continue
            values = metrics[name].get(label)
            if values is None:
                problems.append("%s: %s has no label %s (it has: %s)" %
                                (where, name, label, ", ".join(sorted(metrics[name])) or "none"))
                continue
            if "$" in value:  # a dashboard variable
                continue
            wanted = [value] if op == "=" else _literal_words(value) if op == "=~" else []
            for w in wanted or []:
                if w not in values:
                    problems.append("%s: no %s sample has %s=%r (values: %s)" %
                                    (where, name, label, w, ", ".join(sorted(values))))
    for keyword, labels, first, last in groupings:
        names = [name for k, name, _ in selectors if first <= k <= last]
        have = set(TARGET_LABELS)
        for name in names:
            if ":" in name or name in ALLOWED_METRICS:
                have = None  # a recorded series keeps its source's labels: not checked here
                break
            have |= set(metrics.get(name, {}))
        if have is None:
            continue
        for label in labels:
            if label not in have:
                problems.append("%s: %s (%s): no metric among %s has label %s" %
                                (where, keyword, ", ".join(labels), ", ".join(names), label))
    return problems


def load_rules():
    with open(RULES) as f:
        return yaml.safe_load(f)


def load_dashboard():
    with open(DASHBOARD) as f:
        return json.load(f)


def rule_exprs(rules):
    for group in rules["groups"]:
        for r in group["rules"]:
            yield "rule %s" % (r.get("alert") or r.get("record")), r["expr"]


def recorded_names(rules):
    return {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}


def dashboard_panels(dash):
    for p in dash["panels"]:
        yield p
        for q in p.get("panels", ()):  # a collapsed row keeps its panels inside it
            yield q


def dashboard_exprs(dash):
    for p in dashboard_panels(dash):
        for t in p.get("targets", ()):
            yield "panel %d %r %s" % (p["id"], p["title"], t.get("refId")), t.get("expr", "")
    for v in dash["templating"]["list"]:
        if v["type"] != "query":
            continue
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        m = re.fullmatch(r"\s*label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*", q)
        assert m, "variable %s: not label_values(selector, label): %r" % (v["name"], q)
        # the label must be on the metric: checked as a by-clause over the selector
        yield "variable %s" % v["name"], "count by (%s) (%s)" % (m.group(2), m.group(1))


# ---- the live daemon ----------------------------------------------------------------------

@pytest.fixture
def live_metrics(daemon_factory):
    """exported() of a daemon with the default fs L2 and the LMCache endpoint, after one
    LOOKUP/PUT so that nothing is lazily absent."""
    d = daemon_factory(start=False)
    d.args += ["--lmcache-listen", "ipc://" + os.path.join(d.run_dir, "lmcache.sock")]
    d.start()
    sock = d.dealer()
    d.hello(sock, "contrib")
    d.lookup(sock, "contrib", [b"k" * 16])
    _, samples = d.metrics()
    m = exported(samples)
    assert any(n.startswith("kvtier_l2_") for n in m), "the daemon exports no L2 metrics"
    assert any(n.startswith("kvtier_lmcache_") for n in m), "no LMCache metrics"
    return m


def test_rules_name_only_what_the_daemon_exports(live_metrics):
    rules = load_rules()
    recorded = recorded_names(rules)
    problems = []
    for where, expr in rule_exprs(rules):
        problems += check_expr(where, expr, live_metrics, recorded)
    assert not problems, "contrib/prometheus/kvtier-rules.yml:\n" + "\n".join(problems)


def test_dashboard_names_only_what_the_daemon_exports(live_metrics):
    recorded = recorded_names(load_rules())
    problems = []
    for where, expr in dashboard_exprs(load_dashboard()):
        problems += check_expr(where, expr, live_metrics, recorded)
    assert not problems, "contrib/grafana/kvtier.json:\n" + "\n".join(problems)


# ---- the checker itself (no daemon): it must be able to fail -----------------------------

_SAMPLE = """\
# HELP kvtier_request_errors_total Errors.
# TYPE kvtier_request_errors_total counter
kvtier_request_errors_total{code="no_space"} 0
kvtier_request_errors_total{code="busy"} 0
# HELP kvtier_request_duration_seconds Latency.
# TYPE kvtier_request_duration_seconds histogram
kvtier_request_duration_seconds_bucket{type="get",le="+Inf"} 0
kvtier_request_duration_seconds_sum{type="get"} 0
kvtier_request_duration_seconds_count{type="get"} 0
# HELP kvtier_l2_up Up.
# TYPE kvtier_l2_up gauge
kvtier_l2_up{adapter="fs:/x"} 1
"""


@pytest.mark.parametrize("expr,complaint", [
    ('rate(kvtier_request_error_total[5m])', "kvtier_request_error_total is not in"),
    ('kvtier_request_duration_seconds{type="get"}', "kvtier_request_duration_seconds is not in"),
    ('rate(kvtier_request_duration_seconds_bucket{typ="get"}[5m])', "has no label typ"),
    ('rate(kvtier_request_errors_total{code="nospace"}[5m])', "code='nospace'"),
    ('rate(kvtier_request_errors_total{code=~"internal|busy"}[5m])', "code='internal'"),
    ('sum by (instance, reason) (rate(kvtier_request_errors_total[5m]))', "has label reason"),
    ('sum(rate(kvtier_request_errors_total[5m])) without (adapter)', "has label adapter"),
    ('kvtier_l2_up == 0 and on (instance, tier) kvtier_l2_up', "has label tier"),
    ('kvtier:l2_up:ratio > 0', "not a recording rule"),
    ('node_load1 > 2', "not a kvtier_* metric"),
])
def test_checker_finds_mistakes(expr, complaint):
    _, samples = parse_metrics(_SAMPLE)
    problems = check_expr("t", expr, exported(samples), {"kvtier:l2_errors:rate5m"})
    assert any(complaint in p for p in problems), problems


@pytest.mark.parametrize("expr", [
    'sum without (code) (rate(kvtier_request_errors_total{code=~"no_space|busy"}[5m])) > 0',
    'histogram_quantile(0.99, sum by (instance, type, le) '
    '(rate(kvtier_request_duration_seconds_bucket{job=~"$job",type="get"}[5m])))',
    'kvtier_request_duration_seconds_sum / kvtier_request_duration_seconds_count',
    'rate(kvtier_request_errors_total[5m]) > 0 and on (instance) kvtier_l2_up == 1',
    'up{job="kvtier"} == 0',
    'kvtier:l2_errors:rate5m > 0',
])
def test_checker_passes_good_exprs(expr):
    _, samples = parse_metrics(_SAMPLE)
    assert check_expr("t", expr, exported(samples), {"kvtier:l2_errors:rate5m"}) == []


# ---- the dashboard's structure -----------------------------------------------------------

def _overlap(a, b):
    return (a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"] and
            a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"])


def test_dashboard_structure():
    dash = load_dashboard()
    assert 38 <= dash["schemaVersion"] <= 39
    assert dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = variables.get("datasource")
    assert ds and ds["type"] == "datasource" and ds["query"] == "prometheus", \
        "no datasource variable of type prometheus"
    for name in ("job", "instance"):
        assert name in variables and variables[name]["type"] == "query", name
        assert variables[name]["datasource"]["uid"] == "${datasource}", name
    panels = list(dashboard_panels(dash))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat: %s" % sorted(ids)
    seen = []
    for p in panels:
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["y"] >= 0, p["title"]
        assert g["x"] + g["w"] <= 24, "panel %r is wider than the grid" % p["title"]
        for q in seen:
            assert not _overlap(g, q["gridPos"]), \
                "panels %r and %r overlap" % (p["title"], q["title"])
        seen.append(p)
        if p["type"] == "row":
            continue
        assert p.get("datasource", {}).get("uid") == "${datasource}", \
            "panel %r does not use the datasource variable" % p["title"]
        assert p.get("targets"), "panel %r has no query" % p["title"]
        for t in p["targets"]:
            assert t.get("expr", "").strip(), "panel %r: a target without expr" % p["title"]
            assert t.get("datasource", {}).get("uid") == "${datasource}", p["title"]
            assert '$instance' in t["expr"], \
                "panel %r: a query that ignores $instance: %s" % (p["title"], t["expr"])
        assert p["fieldConfig"]["defaults"].get("unit"), "panel %r has no unit" % p["title"]


# ---- the rules' annotations, docs and tests ---------------------------------------------

def _anchors(markdown):
    """GitHub's anchors of the headings of a markdown file."""
    out = set()
    in_code = False
    for line in markdown.split("\n"):
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#+\s+(.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def test_alerts_are_complete_documented_and_tested():
    rules = load_rules()
    with open(OPERATIONS) as f:
        ops = f.read()
    with open(RULES_TEST) as f:
        tests = yaml.safe_load(f)
    anchors = _anchors(ops)
    fired = {}
    for t in tests["tests"]:
        for case in t.get("alert_rule_test", ()):
            fired.setdefault(case["alertname"], []).append(bool(case.get("exp_alerts")))
    alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
    assert alerts
    problems = []
    for r in alerts:
        name = r["alert"]
        if "for" not in r:
            problems.append("%s: no for:" % name)
        if r.get("labels", {}).get("severity") not in ("warning", "critical"):
            problems.append("%s: severity is not warning or critical" % name)
        ann = r.get("annotations", {})
        for k in ("summary", "description", "runbook_url"):
            if not ann.get(k):
                problems.append("%s: no %s annotation" % (name, k))
        if "{{ $labels.instance }}" not in ann.get("summary", "") + ann.get("description", ""):
            problems.append("%s: the annotations do not name the instance" % name)
        page, _, anchor = ann.get("runbook_url", "").partition("#")
        if page != "docs/operations.md" or anchor not in anchors:
            problems.append("%s: runbook_url %r is not a heading of docs/operations.md" %
                            (name, ann.get("runbook_url")))
        if not re.search(r"^\| `%s` \|" % name, ops, re.M):
            problems.append("%s: no row in docs/operations.md's table of alerts" % name)
        cases = fired.get(name, [])
        if True not in cases or False not in cases:
            problems.append("%s: %s needs a case where it fires and one where it does not" %
                            (name, os.path.relpath(RULES_TEST, _REPO)))
    assert not problems, "\n".join(problems)
