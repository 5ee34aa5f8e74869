"""contrib/: the Prometheus rules and the Grafana dashboard against a live daemon.

Every metric that a rule's expr or a dashboard query names must exist in the /metrics of a
running kvtierd (with an L2 adapter and the LMCache endpoint, so that every family is there),
histograms under the suffixed name the query uses (`_bucket`, `_sum`, `_count`); every label a
matcher or a by/without/on/ignoring clause names must exist on those metrics, and every value
an `=` matcher (or a regex that is an alternation of plain words) asks for must be one the
daemon exports. Recording-rule names (`kvtier:...`) must be defined in the rules file. A rename
in the daemon therefore fails here instead of silently emptying a panel or muting an alert.
Binary operations are split at their operator: the labels of `on (...)` must be on both sides'
output, those of `ignoring (...)` on one of them, and those that `group_left (...)` /
`group_right (...)` copy on the "one" side. Each recording rule's output labels come from its
own expression (what its `by`/`without` keep); a dashboard legend's `{{label}}` must be a label
of its query's output (on the metric, and not aggregated away). The PromQL reading below is a
small lexer and operand splitter, enough for these files, not a full parser.

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
except ImportError:  # python3-yaml is in the Makefile's DEB_PY_PKGS: its absence is an error
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



def _need_yaml():
    assert yaml is not None, "python3-yaml is not installed (the Makefile's DEB_PY_PKGS)"


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
            else:  # on/ignoring/group_*: checked by _binary_problems, side by side
                k = end + 1
                continue
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


# ---- operands and output labels ------------------------------------------------------------

# Binary operators by precedence, lowest first (PromQL's order; `^` is right-associative).
_PREC = [{"or"}, {"and", "unless"}, {"==", "!=", "<=", "<", ">=", ">"}, {"+", "-"},
         {"*", "/", "%", "atan2"}, {"^"}]
SCALAR = "scalar"  # _out() of a number or scalar(): matches anything


def _prec(tok):
    kind, text = tok
    if kind == "op" or (kind == "ident" and text in ("and", "or", "unless", "atan2")):
        for level, ops in enumerate(_PREC):
            if text in ops:
                return level
    return None


def _skip_modifiers(toks, k, hi):
    """Index after `bool`, on/ignoring (...), group_left/right [(...)] starting at k, and the
    modifiers as {keyword: [labels]}."""
    mods = {}
    while k <= hi:
        kind, text = toks[k]
        if (kind, text) == ("ident", "bool"):
            k += 1
        elif kind == "ident" and text in ("on", "ignoring", "group_left", "group_right"):
            if k + 1 <= hi and toks[k + 1] == ("punct", "("):
                end = _close(toks, k + 1)
                mods[text] = [t for kd, t in toks[k + 2:end] if kd == "ident"]
                k = end + 1
            else:
                mods[text] = []
                k += 1
        else:
            break
    return k, mods


def _top_binary(toks, lo, hi):
    """(index, modifiers, rhs start) of the operator that splits toks[lo..hi] at the top level
    (the lowest precedence; the rightmost of equals, the leftmost for `^`), or None."""
    best = None
    depth = 0
    k = lo
    while k <= hi:
        t = toks[k]
        if t in (("punct", "("), ("punct", "{")):
            depth += 1
        elif t in (("punct", ")"), ("punct", "}")):
            depth -= 1
        elif depth == 0 and k > lo and _prec(t) is not None:
            prev = toks[k - 1]
            unary = t[1] in "+-" and (_prec(prev) is not None or prev in (
                ("punct", "("), ("punct", ",")))
            if not unary:
                level = _prec(t)
                if best is None or level < best[0] or (level == best[0] and t[1] != "^"):
                    best = (level, k)
        k += 1
    if best is None:
        return None
    rhs, mods = _skip_modifiers(toks, best[1] + 1, hi)
    return best[1], mods, rhs


def _args(toks, lo, hi):
    """The comma-separated ranges inside the brackets toks[lo] .. toks[hi]."""
    out, depth, start = [], 0, lo + 1
    for k in range(lo + 1, hi):
        if toks[k] in (("punct", "("), ("punct", "{")):
            depth += 1
        elif toks[k] in (("punct", ")"), ("punct", "}")):
            depth -= 1
        elif depth == 0 and toks[k] == ("punct", ","):
            out.append((start, k - 1))
            start = k + 1
    if start <= hi - 1:
        out.append((start, hi - 1))
    return out


def _labels_of(name, metrics, recorded):
    """The labels of one selector's series, or None when unknown (not exported)."""
    if name in ALLOWED_METRICS:
        return set(TARGET_LABELS)
    if ":" in name:
        got = recorded.get(name) if isinstance(recorded, dict) else None
        return set(got) if got is not None else None
    if name not in metrics:
        return None
    return set(metrics[name]) | TARGET_LABELS


def _out(toks, lo, hi, metrics, recorded, problems, where):
    """The labels of the output of toks[lo..hi] (a set), SCALAR, or None when unknown. Appends
    to `problems` what on/ignoring/group_* name that a side does not have."""
    while lo < hi and toks[lo] == ("punct", "(") and _close(toks, lo) == hi:
        lo, hi = lo + 1, hi - 1
    if lo > hi:
        return None
    split = _top_binary(toks, lo, hi)
    if split:
        k, mods, rhs = split
        op = toks[k][1]
        left = _out(toks, lo, k - 1, metrics, recorded, problems, where)
        right = _out(toks, rhs, hi, metrics, recorded, problems, where)
        sides = [("left", left), ("right", right)]
        known = [(n, o) for n, o in sides if o is not None and o is not SCALAR]
        for label in mods.get("on", []):
            for side, o in known:
                if label not in o:
                    problems.append("%s: on (%s): the %s side of %r has no label %s" %
                                    (where, ", ".join(mods["on"]), side, op, label))
        if "ignoring" in mods and len(known) == 2:
            for label in mods["ignoring"]:
                if not any(label in o for _, o in known):
                    problems.append("%s: ignoring (%s): neither side of %r has label %s" %
                                    (where, ", ".join(mods["ignoring"]), op, label))
        for g, one in (("group_left", right), ("group_right", left)):
            if one is not None and one is not SCALAR:
                for label in mods.get(g, []):
                    if label not in one:
                        problems.append("%s: %s (%s): the one side of %r has no label %s" %
                                        (where, g, ", ".join(mods[g]), op, label))
        if op in ("and", "unless"):
            return left
        if op == "or":
            return None if left is None or right is None else left | right
        if left is SCALAR:
            return right
        if right is SCALAR:
            return left
        if left is None or right is None:
            return None
        many, one = (right, left) if "group_right" in mods else (left, right)
        if "group_left" in mods or "group_right" in mods:
            return many | set(mods.get("group_left", mods.get("group_right", [])))
        if "on" in mods:
            return set(mods["on"])
        return left - set(mods.get("ignoring", []))
    kind, text = toks[lo]
    if kind == "number":
        return SCALAR
    if kind == "op" and text in "+-":  # unary
        return _out(toks, lo + 1, hi, metrics, recorded, problems, where)
    if kind != "ident":
        return None
    nxt = toks[lo + 1] if lo + 1 <= hi else None
    if text in AGGREGATIONS:
        k = lo + 1
        clause, labels = None, []
        if k <= hi and toks[k][0] == "ident" and toks[k][1] in ("by", "without"):
            clause = toks[k][1]
            end = _close(toks, k + 1)
            labels = [t for kd, t in toks[k + 2:end] if kd == "ident"]
            k = end + 1
        body_end = _close(toks, k)
        if body_end < hi and toks[body_end + 1][1] in ("by", "without"):
            clause = toks[body_end + 1][1]
            end = _close(toks, body_end + 2)
            labels = [t for kd, t in toks[body_end + 3:end] if kd == "ident"]
        args = _args(toks, k, body_end)
        inner = _out(toks, args[-1][0], args[-1][1], metrics, recorded, problems, where) \
            if args else None
        if clause == "by":
            out = set(labels)
        elif inner is None or inner is SCALAR:
            return None
        elif clause == "without":
            out = inner - set(labels)
        elif text in ("topk", "bottomk"):
            out = inner
        else:
            out = set()
        if text == "count_values" and args:
            out = out | {t for kd, t in toks[args[0][0]:args[0][1] + 1] if kd == "string"}
        return out
    if nxt == ("punct", "("):  # a function
        end = _close(toks, lo + 1)
        args = _args(toks, lo + 1, end)
        outs = [_out(toks, a, b, metrics, recorded, problems, where) for a, b in args]
        vec = [o for o in outs if o is not SCALAR]
        if text in ("scalar", "time", "pi"):
            return SCALAR
        if text == "vector":
            return set()
        if text == "absent":
            sel = parse_promql(" ".join(_render(t) for t in toks[args[0][0]:args[0][1] + 1]))[0] \
                if args else []
            return {lb for _, _, ms in sel for lb, op, _ in ms if op == "="}
        if text == "histogram_quantile":
            return None if not vec or vec[-1] is None else vec[-1] - {"le"}
        if text == "label_replace" and outs and outs[0] not in (None, SCALAR):
            return outs[0] | {toks[args[1][0]][1]}
        if text == "label_join" and outs and outs[0] not in (None, SCALAR):
            return outs[0] | {toks[args[1][0]][1]}
        return vec[0] if vec else None
    if text in KEYWORDS or text in GROUPING:
        return None
    return _labels_of(text, metrics, recorded)


def _render(tok):
    kind, text = tok
    return json.dumps(text) if kind == "string" else text


def output_labels(expr, metrics, recorded):
    """The labels of expr's output series (a set), or None when they cannot be told (a metric
    the daemon does not export, an expression the splitter does not read)."""
    try:
        toks = _lex(expr)
        out = _out(toks, 0, len(toks) - 1, metrics, recorded, [], "")
    except (ValueError, IndexError):
        return None
    return None if out is SCALAR else out


def recorded_labels(rules, metrics):
    """{record name: its output labels (None when unknown)}, from each rule's expression, in
    file order (a rule may use an earlier one)."""
    out = {}
    for g in rules["groups"]:
        for r in g["rules"]:
            if "record" in r:
                out[r["record"]] = output_labels(r["expr"], metrics, out)
    return out


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
            got = _labels_of(name, metrics, recorded)
            if got is None:
                have = None  # an unknown name, reported above
                break
            have |= got
        if have is None:
            continue
        for label in labels:
            if label not in have:
                problems.append("%s: %s (%s): no metric among %s has label %s" %
                                (where, keyword, ", ".join(labels), ", ".join(names), label))
    # on/ignoring/group_*: side by side, at the binary operator
    try:
        toks = _lex(expr)
        _out(toks, 0, len(toks) - 1, metrics, recorded, problems, where)
    except (ValueError, IndexError) as e:
        problems.append("%s: cannot split %r: %s" % (where, expr, e))
    return problems


def check_legend(where, expr, legend, metrics, recorded):
    """Problems with a legendFormat: each {{label}} must be a label of expr's output."""
    names = re.findall(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", legend or "")
    if not names:
        return []
    out = output_labels(expr, metrics, recorded)
    if out is None:
        return ["%s: cannot tell the output labels of %r for its legend %r" % (where, expr,
                                                                                 legend)]
    return ["%s: legend {{%s}}: not a label of the output of %r (it has: %s)" %
            (where, n, expr, ", ".join(sorted(out)) or "none") for n in names if n not in out]


def load_rules():
    _need_yaml()
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


def dashboard_legends(dash):
    for p in dashboard_panels(dash):
        for t in p.get("targets", ()):
            yield ("panel %d %r %s" % (p["id"], p["title"], t.get("refId")), t.get("expr", ""),
                   t.get("legendFormat", ""))


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
    recorded = recorded_labels(rules, live_metrics)
    unknown = sorted(n for n, o in recorded.items() if o is None)
    assert not unknown, "cannot tell the labels of recording rules %s" % unknown
    problems = []
    for where, expr in rule_exprs(rules):
        problems += check_expr(where, expr, live_metrics, recorded)
    assert not problems, "contrib/prometheus/kvtier-rules.yml:\n" + "\n".join(problems)


def test_dashboard_names_only_what_the_daemon_exports(live_metrics):
    # recorded series (should a panel use one) carry the labels their rule's expression keeps
    recorded = recorded_labels(load_rules(), live_metrics)
    dash = load_dashboard()
    problems = []
    for where, expr in dashboard_exprs(dash):
        problems += check_expr(where, expr, live_metrics, recorded)
    for where, expr, legend in dashboard_legends(dash):
        problems += check_legend(where, expr, legend, live_metrics, recorded)
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
# HELP kvtier_lookup_keys_total Keys.
# TYPE kvtier_lookup_keys_total counter
kvtier_lookup_keys_total 0
# HELP kvtier_lookup_hit_keys_total Hits.
# TYPE kvtier_lookup_hit_keys_total counter
kvtier_lookup_hit_keys_total{tier="l1"} 0
"""
_RECORDED = {"groups": [{"rules": [
    {"record": "kvtier:l2_errors:rate5m", "expr": "rate(kvtier_l2_up[5m])"},
    {"record": "kvtier:errors:sum", "expr": "sum by (instance) (kvtier_request_errors_total)"},
]}]}


def _sample_metrics():
    _, samples = parse_metrics(_SAMPLE)
    return exported(samples)


@pytest.mark.parametrize("expr,complaint", [
    ('rate(kvtier_request_error_total[5m])', "kvtier_request_error_total is not in"),
    ('kvtier_request_duration_seconds{type="get"}', "kvtier_request_duration_seconds is not in"),
    ('rate(kvtier_request_duration_seconds_bucket{typ="get"}[5m])', "has no label typ"),
    ('rate(kvtier_request_errors_total{code="nospace"}[5m])', "code='nospace'"),
    ('rate(kvtier_request_errors_total{code=~"internal|busy"}[5m])', "code='internal'"),
    ('sum by (instance, reason) (rate(kvtier_request_errors_total[5m]))', "has label reason"),
    ('sum(rate(kvtier_request_errors_total[5m])) without (adapter)', "has label adapter"),
    ('kvtier_l2_up == 0 and on (instance, tier) kvtier_l2_up', "has no label tier"),
    # on (...) labels on both sides: only the left one has tier
    ('rate(kvtier_lookup_hit_keys_total[1m]) / on (instance, tier) '
     'rate(kvtier_lookup_keys_total[1m])', "the right side of '/' has no label tier"),
    ('kvtier_lookup_keys_total / on (instance, tier) kvtier_lookup_hit_keys_total',
     "the left side of '/' has no label tier"),
    ('kvtier_request_errors_total > 0 unless on (instance, adapter) '
     '(min by (instance) (kvtier_l2_up) == 0)', "the left side of 'unless' has no label adapter"),
    ('kvtier_request_errors_total / ignoring (tier) kvtier_lookup_keys_total',
     "neither side of '/' has label tier"),
    ('kvtier_lookup_hit_keys_total / ignoring (tier) group_left (adapter) kvtier_lookup_keys_total',
     "group_left (adapter): the one side of '/' has no label adapter"),
    # a recorded series has the labels its rule's expression keeps
    ('sum by (code) (kvtier:errors:sum)', "has label code"),
    ('kvtier:l2_up:ratio > 0', "not a recording rule"),
    ('node_load1 > 2', "not a kvtier_* metric"),
])
def test_checker_finds_mistakes(expr, complaint):
    m = _sample_metrics()
    problems = check_expr("t", expr, m, recorded_labels(_RECORDED, m))
    assert any(complaint in p for p in problems), problems


@pytest.mark.parametrize("expr", [
    'sum without (code) (rate(kvtier_request_errors_total{code=~"no_space|busy"}[5m])) > 0',
    'histogram_quantile(0.99, sum by (instance, type, le) '
    '(rate(kvtier_request_duration_seconds_bucket{job=~"$job",type="get"}[5m])))',
    'kvtier_request_duration_seconds_sum / kvtier_request_duration_seconds_count',
    'rate(kvtier_request_errors_total[5m]) > 0 and on (instance) kvtier_l2_up == 1',
    'up{job="kvtier"} == 0',
    'kvtier:l2_errors:rate5m > 0',
    'sum by (instance) (kvtier:l2_errors:rate5m) > 0',
    'rate(kvtier_lookup_hit_keys_total[1m]) / ignoring (tier) group_left '
    'rate(kvtier_lookup_keys_total[1m])',
    'kvtier_request_errors_total > 0 unless on (job, instance) '
    '(min by (job, instance) (kvtier_l2_up) == 0)',
    'group by (job, instance) (max_over_time(up{job="kvtier"}[1h])) '
    'unless on (job, instance) up{job="kvtier"}',
])
def test_checker_passes_good_exprs(expr):
    m = _sample_metrics()
    assert check_expr("t", expr, m, recorded_labels(_RECORDED, m)) == []


def test_recorded_labels_come_from_the_rule():
    m = _sample_metrics()
    rec = recorded_labels(_RECORDED, m)
    assert rec["kvtier:errors:sum"] == {"instance"}
    assert rec["kvtier:l2_errors:rate5m"] == {"job", "instance", "adapter"}


@pytest.mark.parametrize("expr,legend,complaint", [
    ('sum by (instance) (rate(kvtier_request_errors_total[5m]))', "{{instance}} {{code}}",
     "legend {{code}}"),
    ('rate(kvtier_request_errors_total[5m])', "{{instance}} {{adapter}}", "legend {{adapter}}"),
    ('sum without (tier) (rate(kvtier_lookup_hit_keys_total[1m]))', "{{ tier }}",
     "legend {{tier}}"),
    ('histogram_quantile(0.99, rate(kvtier_request_duration_seconds_bucket[5m]))', "{{le}}",
     "legend {{le}}"),
    ('kvtier:errors:sum', "{{instance}} {{code}}", "legend {{code}}"),
])
def test_checker_finds_bad_legends(expr, legend, complaint):
    m = _sample_metrics()
    problems = check_legend("t", expr, legend, m, recorded_labels(_RECORDED, m))
    assert any(complaint in p for p in problems), problems


@pytest.mark.parametrize("expr,legend", [
    ('rate(kvtier_request_errors_total[5m]) > 0', "{{instance}} {{code}}"),
    ('histogram_quantile(0.99, rate(kvtier_request_duration_seconds_bucket[5m]))',
     "{{instance}} {{type}}"),
    ('rate(kvtier_lookup_hit_keys_total[1m]) / ignoring (tier) group_left '
     'rate(kvtier_lookup_keys_total[1m])', "{{instance}} {{tier}}"),
    ('sum by (job, instance) (kvtier_l2_up)', "{{job}} {{instance}}"),
    ('kvtier:l2_errors:rate5m', "{{instance}} {{adapter}}"),
    ('kvtier_l2_up', "{{instance}} up"),
])
def test_checker_passes_good_legends(expr, legend):
    m = _sample_metrics()
    assert check_legend("t", expr, legend, m, recorded_labels(_RECORDED, m)) == []


def test_missing_yaml_fails(monkeypatch):
    monkeypatch.setattr(__import__(__name__), "yaml", None, raising=True)
    with pytest.raises(AssertionError, match="python3-yaml"):
        load_rules()


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
    _need_yaml()
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
        # absent(...) has no instance to name (its series has only the selector's = labels)
        who = "{{ $labels.job }}" if r["expr"].lstrip().startswith("absent(") else \
            "{{ $labels.instance }}"
        if who not in ann.get("summary", "") + ann.get("description", ""):
            problems.append("%s: the annotations do not name %s" % (name, who))
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
