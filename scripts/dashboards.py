#!/usr/bin/env python3
"""The fleet dashboards: one table of panels, written as a Grafana dashboard and as the
equivalent Cloud Monitoring dashboard (PromQL on Managed Prometheus), and checked.

  scripts/dashboards.py generate   writes dashboards/grafana/spotinfer.json and
                                   dashboards/cloud-monitoring/spotinfer.json from PANELS
  scripts/dashboards.py check      validates both (what CI runs, through scripts/lint-deploy.sh)
      [--exposed FILE]             a worker's /metrics (default dashboards/worker-metrics.txt,
                                   a real scrape saved by `spotinfer loadtest`)
      [--grafana F] [--cloud-monitoring F]   other dashboard files (tests)

`check` fails when:
  - a dashboard breaks the structure its product needs (Grafana: panels with ids, grid positions
    inside 24 columns and not overlapping, a Prometheus datasource through the `datasource`
    variable, targets with refIds and expressions; Cloud Monitoring: a mosaicLayout whose tiles
    fit its columns without overlapping, each an xyChart whose dataSets hold a
    timeSeriesQuery.prometheusQuery),
  - a query names a metric that is neither a sample the worker exposes (the scrape) nor one of
    Google's (dashboards/google-metrics.txt: Pub/Sub's and GKE's, in their PromQL names),
  - a query uses a variable the dashboard does not define, or unbalanced brackets,
  - the two dashboards do not chart the same queries under the same titles,
  - the files are not what `generate` writes,
  - or the check itself no longer catches a misspelt metric (it misspells one in each dashboard
    and expects exactly that name reported).
Standard library only; runs in well under a second.
"""

import copy
import difflib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "dashboards/grafana/spotinfer.json"
CLOUD = ROOT / "dashboards/cloud-monitoring/spotinfer.json"
EXPOSED = ROOT / "dashboards/worker-metrics.txt"
GOOGLE = ROOT / "dashboards/google-metrics.txt"

# Placeholders in PANELS: the rate window (Grafana's $__rate_interval, Cloud Monitoring's
# ${__interval}) and the subscription (a Grafana variable; a literal in Cloud Monitoring,
# which has no free-text variables in PromQL: edit it there, see docs/dashboards.md).
RATE = "{RATE}"
SUB = "{SUB}"
DEFAULT_SUBSCRIPTION = "spotinfer-workers"


def rate(metric, by=""):
    grouping = f" by ({by}) " if by else ""
    return f"sum{grouping}(rate({metric}[{RATE}]))"


def quantile(q, metric):
    return f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket[{RATE}])))"


def mean(metric):
    return f"sum(rate({metric}_sum[{RATE}])) / sum(rate({metric}_count[{RATE}]))"


SUBSCRIPTION = f'{{subscription_id="{SUB}"}}'

# (title, unit, description, [(legend, query)]). Grafana units; Cloud Monitoring gets "s" for
# seconds and an axis label otherwise.
PANELS = [
    (
        "Throughput: records committed/s",
        "records/s",
        "Result rows committed per second, all workers and per pod.",
        [
            ("all workers", rate("spotinfer_records_committed_total")),
            ("{{pod}}", rate("spotinfer_records_committed_total", "pod")),
        ],
    ),
    (
        "Commit latency",
        "s",
        "Seconds per commit transaction (spotinfer_commit_seconds).",
        [
            ("p50", quantile(0.5, "spotinfer_commit_seconds")),
            ("p95", quantile(0.95, "spotinfer_commit_seconds")),
            ("p99", quantile(0.99, "spotinfer_commit_seconds")),
        ],
    ),
    (
        "Batch size",
        "records",
        "Records per model batch (spotinfer_batch_size).",
        [
            ("mean", mean("spotinfer_batch_size")),
            ("p50", quantile(0.5, "spotinfer_batch_size")),
            ("p95", quantile(0.95, "spotinfer_batch_size")),
        ],
    ),
    (
        "In-flight messages per pod",
        "messages",
        "Messages held and not yet settled (acked, NACKed or handed back).",
        [("{{pod}}", "sum by (pod) (spotinfer_in_flight_messages)")],
    ),
    (
        "NACKs and hand-backs at shutdown",
        "messages/s",
        "NACKed after a failure (commit, model, input read) and handed back unprocessed at "
        "SIGTERM or an early drain: each is one delivery attempt towards the dead-letter limit. "
        "A worker exits right after its SIGTERM hand-back, usually before the next scrape: "
        "Pub/Sub's own NACK count sees every one.",
        [
            ("NACKed after a failure", rate("spotinfer_messages_nacked_total")),
            ("handed back at shutdown", rate("spotinfer_messages_released_on_shutdown_total")),
            (
                "NACKs Pub/Sub received (all kinds)",
                f"sum(rate(pubsub_googleapis_com:subscription_nack_requests{SUBSCRIPTION}[{RATE}]))",
            ),
            (
                "leases expired (SIGKILL, stalls)",
                f"sum(rate(pubsub_googleapis_com:subscription_expired_ack_deadlines_count{SUBSCRIPTION}[{RATE}]))",
            ),
        ],
    ),
    (
        "Delivery attempts",
        "attempt",
        "Pub/Sub's delivery attempt of the messages received (subscriptions with a dead-letter "
        "policy only): rising attempts walk messages towards the dead-letter limit.",
        [
            ("mean", mean("spotinfer_delivery_attempt")),
            ("p95", quantile(0.95, "spotinfer_delivery_attempt")),
            ("p99", quantile(0.99, "spotinfer_delivery_attempt")),
        ],
    ),
    (
        "Failures by kind",
        "per second",
        "The worker has no failure counter labelled by reason: one counter per kind. Bad "
        "payloads are recorded in failed_records (the reason is in the row); commits and model "
        "batches that failed are retried; dead-lettered messages are Pub/Sub's count.",
        [
            ("bad payloads recorded", rate("spotinfer_records_failed_total")),
            ("commits failed", rate("spotinfer_commit_errors_total")),
            ("model batches failed", rate("spotinfer_model_errors_total")),
            (
                "dead-lettered",
                f"sum(rate(pubsub_googleapis_com:subscription_dead_letter_message_count{SUBSCRIPTION}[{RATE}]))",
            ),
        ],
    ),
    (
        "Subscription backlog",
        "messages",
        "Pub/Sub's count of messages not yet acknowledged on the subscription.",
        [
            (
                "undelivered messages",
                f"sum(pubsub_googleapis_com:subscription_num_undelivered_messages{SUBSCRIPTION})",
            )
        ],
    ),
    (
        "Oldest unacked message age",
        "s",
        "Pub/Sub's age of the oldest message not yet acknowledged: rises while nothing runs "
        "(no Spot capacity, a DWS queue, a crash loop).",
        [
            (
                "oldest unacked",
                f"max(pubsub_googleapis_com:subscription_oldest_unacked_message_age{SUBSCRIPTION})",
            )
        ],
    ),
    (
        "Preemptions and workers",
        "count",
        "GKE's count of Spot node preemptions (kubernetes.io/node/interruption_count, "
        "PreemptionEvent, sampled every 60 s) next to the workers scraped and the workers ready "
        "(a worker draining after SIGTERM is up but not ready).",
        [
            (
                "node preemptions (10 min)",
                'sum(max_over_time(kubernetes_io:node_interruption_count{monitored_resource="k8s_node", interruption_type="PreemptionEvent"}[10m]))',
            ),
            ("workers up", "count(spotinfer_ready)"),
            ("workers ready", "sum(spotinfer_ready)"),
        ],
    ),
    (
        "Stalled workers",
        "s",
        "Seconds a worker has held messages without progress while the database answers; "
        "/healthz fails past the stall threshold (5 min or more).",
        [("{{pod}}", "max by (pod) (spotinfer_stalled_seconds)")],
    ),
]

GRAFANA_UNITS = {"s": "s", "count": "short"}


def grafana_query(q):
    return q.replace(RATE, "$__rate_interval").replace(SUB, "$subscription")


def cloud_query(q):
    return q.replace(RATE, "${__interval}").replace(SUB, DEFAULT_SUBSCRIPTION)


def generate_grafana():
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    panels = []
    for i, (title, unit, description, queries) in enumerate(PANELS):
        defaults = {"unit": GRAFANA_UNITS.get(unit, "short"), "min": 0}
        if unit not in GRAFANA_UNITS:
            defaults["custom"] = {"axisLabel": unit}
        panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": title,
                "description": description,
                "datasource": datasource,
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {"defaults": defaults, "overrides": []},
                "options": {
                    "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "none"},
                },
                "targets": [
                    {
                        "refId": chr(ord("A") + j),
                        "datasource": datasource,
                        "expr": grafana_query(q),
                        "legendFormat": legend,
                        "range": True,
                    }
                    for j, (legend, q) in enumerate(queries)
                ],
            }
        )
    return {
        "title": "spotinfer fleet",
        "uid": "spotinfer-fleet",
        "description": "spotinfer workers on GKE Spot: throughput, commits, batches, "
        "redeliveries, failures, the subscription's backlog and preemptions. Generated by "
        "scripts/dashboards.py; see docs/dashboards.md.",
        "tags": ["spotinfer"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "1m",
        "timezone": "",
        "annotations": {"list": []},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                {
                    "name": "subscription",
                    "label": "Subscription",
                    "type": "textbox",
                    "query": DEFAULT_SUBSCRIPTION,
                    "current": {"text": DEFAULT_SUBSCRIPTION, "value": DEFAULT_SUBSCRIPTION},
                    "hide": 0,
                },
            ]
        },
        "panels": panels,
    }


def generate_cloud():
    tiles = []
    for i, (title, unit, _description, queries) in enumerate(PANELS):
        data_sets = []
        for legend, q in queries:
            query = {"prometheusQuery": cloud_query(q)}
            if unit == "s":
                query["unitOverride"] = "s"
            data_set = {"timeSeriesQuery": query, "plotType": "LINE", "targetAxis": "Y1"}
            if "{{" not in legend:
                data_set["legendTemplate"] = legend
            data_sets.append(data_set)
        tiles.append(
            {
                "xPos": 24 * (i % 2),
                "yPos": 16 * (i // 2),
                "width": 24,
                "height": 16,
                "widget": {
                    "title": title,
                    "xyChart": {
                        "dataSets": data_sets,
                        "chartOptions": {"mode": "COLOR"},
                        "yAxis": {"label": unit, "scale": "LINEAR"},
                    },
                },
            }
        )
    return {
        "displayName": "spotinfer fleet",
        "labels": {"spotinfer": ""},
        "mosaicLayout": {"columns": 48, "tiles": tiles},
    }


def dump(doc):
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


# --- checking ------------------------------------------------------------------------------

PROMQL_KEYWORDS = {
    "and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
    "group_left", "group_right", "inf", "nan", "atan2", "start", "end",
}  # fmt: skip
GRAFANA_VARIABLES = {"$__rate_interval", "$__interval", "$__range", "$subscription"}
CLOUD_VARIABLES = {"${__interval}"}


def exposed_names(text):
    """Sample names of a Prometheus/OpenMetrics text exposition."""
    names = set()
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        names.add(re.match(r"[^{\s]+", line).group(0))
    return names


def google_names(text):
    return {
        line.split("#")[0].strip()
        for line in text.splitlines()
        if line.split("#")[0].strip()
    }


def metric_names(expr):
    """Every metric a PromQL expression selects (by name), in order."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"'(?:[^'\\]|\\.)*'", "''", s)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"\boffset\s+-?[0-9a-zA-Z_$]+", " ", s)
    s = re.sub(r"(?<![A-Za-z0-9_:])[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?", " ", s)
    names = []
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        token = m.group(0)
        if s[m.end():].lstrip().startswith("(") or token.lower() in PROMQL_KEYWORDS:
            continue
        names.append(token)
    return names


def query_problems(expr, known, variables):
    problems = []
    if not expr.strip():
        return ["empty query"]
    if "__name__" in expr:
        problems.append("selects by __name__: its metric cannot be checked")
    for opening, closing in ("()", "[]", "{}"):
        if expr.count(opening) != expr.count(closing):
            problems.append(f"unbalanced {opening}{closing}")
    for var in re.findall(r"\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*", expr):
        if var not in variables:
            problems.append(f"unknown variable {var}")
    names = metric_names(expr)
    if not names:
        problems.append("no metric named")
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            problems.append(f"unknown metric {name}{hint}")
    return problems


def overlaps(boxes):
    """Pairs of (name, x, y, w, h) boxes that overlap."""
    out = []
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if a[1] < b[1] + b[3] and b[1] < a[1] + a[3] and a[2] < b[2] + b[4] and b[2] < a[2] + a[4]:
                out.append(f"{a[0]!r} overlaps {b[0]!r}")
    return out


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def check_grafana(doc, known):
    """Problems of a Grafana dashboard, and its {title: [query]}."""
    problems, queries = [], {}
    for key in ("title", "uid"):
        if not isinstance(doc.get(key), str) or not doc.get(key):
            problems.append(f"grafana: no {key}")
    if not is_int(doc.get("schemaVersion")):
        problems.append("grafana: schemaVersion is not an integer")
    variables = doc.get("templating", {}).get("list", [])
    ds = [v for v in variables if v.get("name") == "datasource"]
    if not ds or ds[0].get("type") != "datasource" or ds[0].get("query") != "prometheus":
        problems.append("grafana: no `datasource` variable of type datasource, query prometheus")
    defined = GRAFANA_VARIABLES | {f"${v.get('name')}" for v in variables}
    panels = doc.get("panels")
    if not isinstance(panels, list) or not panels:
        return problems + ["grafana: no panels"], queries
    ids, boxes = set(), []
    for p in panels:
        title = p.get("title") or f"panel {p.get('id')}"
        where = f"grafana: panel {title!r}"
        if p.get("type") == "row":
            continue
        if not is_int(p.get("id")) or p["id"] in ids:
            problems.append(f"{where}: missing or duplicate id")
        ids.add(p.get("id"))
        if not p.get("title"):
            problems.append(f"{where}: no title")
        if p.get("type") not in {"timeseries", "stat", "gauge", "bargauge", "table", "heatmap"}:
            problems.append(f"{where}: unexpected type {p.get('type')!r}")
        grid = p.get("gridPos", {})
        if not all(is_int(grid.get(k)) for k in "xywh"):
            problems.append(f"{where}: gridPos needs integer x, y, w, h")
        else:
            if grid["x"] < 0 or grid["w"] < 1 or grid["x"] + grid["w"] > 24 or grid["h"] < 1:
                problems.append(f"{where}: gridPos outside the 24 columns")
            boxes.append((title, grid["x"], grid["y"], grid["w"], grid["h"]))
        if p.get("datasource") != {"type": "prometheus", "uid": "${datasource}"}:
            problems.append(f"{where}: datasource is not the `datasource` variable (Prometheus)")
        targets = p.get("targets")
        if not isinstance(targets, list) or not targets:
            problems.append(f"{where}: no targets")
            continue
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs) or not all(refs):
            problems.append(f"{where}: missing or duplicate refId")
        for t in targets:
            expr = t.get("expr", "")
            if t.get("datasource", p.get("datasource")) != p.get("datasource"):
                problems.append(f"{where} {t.get('refId')}: a different datasource")
            for problem in query_problems(expr, known, defined):
                problems.append(f"{where} {t.get('refId')}: {problem}: {expr}")
            queries.setdefault(title, []).append(expr)
    problems += [f"grafana: {o}" for o in overlaps(boxes)]
    return problems, queries


CLOUD_TOP = {"displayName", "mosaicLayout", "labels", "dashboardFilters", "etag", "name", "description"}
PLOT_TYPES = {"LINE", "STACKED_AREA", "STACKED_BAR", "HEATMAP"}


def check_cloud(doc, known):
    """Problems of a Cloud Monitoring dashboard, and its {title: [query]}."""
    problems, queries = [], {}
    for key in doc:
        if key not in CLOUD_TOP:
            problems.append(f"cloud monitoring: unknown top-level field {key!r}")
    if not isinstance(doc.get("displayName"), str) or not doc.get("displayName"):
        problems.append("cloud monitoring: no displayName")
    layout = doc.get("mosaicLayout")
    if not isinstance(layout, dict):
        return problems + ["cloud monitoring: no mosaicLayout"], queries
    columns = layout.get("columns")
    if not is_int(columns) or not 1 <= columns <= 48:
        problems.append("cloud monitoring: mosaicLayout.columns must be 1 to 48")
        columns = 48
    tiles = layout.get("tiles")
    if not isinstance(tiles, list) or not tiles:
        return problems + ["cloud monitoring: no tiles"], queries
    boxes = []
    for n, tile in enumerate(tiles):
        widget = tile.get("widget", {})
        title = widget.get("title") or f"tile {n}"
        where = f"cloud monitoring: tile {title!r}"
        if not widget.get("title"):
            problems.append(f"{where}: no title")
        if not all(is_int(tile.get(k)) for k in ("xPos", "yPos", "width", "height")):
            problems.append(f"{where}: needs integer xPos, yPos, width, height")
        else:
            if tile["xPos"] < 0 or tile["width"] < 1 or tile["xPos"] + tile["width"] > columns:
                problems.append(f"{where}: outside the {columns} columns")
            boxes.append((title, tile["xPos"], tile["yPos"], tile["width"], tile["height"]))
        chart = widget.get("xyChart")
        if not isinstance(chart, dict):
            problems.append(f"{where}: not an xyChart")
            continue
        data_sets = chart.get("dataSets")
        if not isinstance(data_sets, list) or not data_sets:
            problems.append(f"{where}: no dataSets")
            continue
        for d in data_sets:
            if d.get("plotType", "LINE") not in PLOT_TYPES:
                problems.append(f"{where}: unknown plotType {d.get('plotType')!r}")
            tsq = d.get("timeSeriesQuery", {})
            expr = tsq.get("prometheusQuery")
            if not isinstance(expr, str):
                problems.append(f"{where}: a dataSet without timeSeriesQuery.prometheusQuery")
                continue
            for problem in query_problems(expr, known, CLOUD_VARIABLES):
                problems.append(f"{where}: {problem}: {expr}")
            queries.setdefault(title, []).append(expr)
    problems += [f"cloud monitoring: {o}" for o in overlaps(boxes)]
    return problems, queries


def parity_problems(grafana_queries, cloud_queries, subscription):
    """The two dashboards must chart the same queries under the same titles."""

    def norm_g(q):
        return q.replace("$__rate_interval", "RATE").replace("$subscription", subscription)

    def norm_c(q):
        return q.replace("${__interval}", "RATE")

    problems = []
    for title in sorted(set(grafana_queries) | set(cloud_queries)):
        g = sorted(map(norm_g, grafana_queries.get(title, [])))
        c = sorted(map(norm_c, cloud_queries.get(title, [])))
        if g != c:
            problems.append(f"parity: {title!r} differs: grafana {g} vs cloud monitoring {c}")
    return problems


def check_all(grafana, cloud, known):
    subscription = next(
        (
            v.get("query")
            for v in grafana.get("templating", {}).get("list", [])
            if v.get("name") == "subscription"
        ),
        DEFAULT_SUBSCRIPTION,
    )
    p1, q1 = check_grafana(grafana, known)
    p2, q2 = check_cloud(cloud, known)
    return p1 + p2 + parity_problems(q1, q2, subscription), q1, q2


def misspell(name):
    """A plausible typo: one letter dropped from the middle."""
    i = len(name) // 2
    return name[:i] + name[i + 1:]


def self_test(grafana, cloud, known):
    """The check must report a misspelt metric, in each dashboard, worker's and Google's alike."""
    failures = []
    for prefix in ("spotinfer_", "pubsub_googleapis_com:"):
        for which in ("grafana", "cloud monitoring"):
            g, c = copy.deepcopy(grafana), copy.deepcopy(cloud)
            if which == "grafana":
                target = next(
                    t for p in g["panels"] for t in p.get("targets", [])
                    if any(n.startswith(prefix) for n in metric_names(t["expr"]))
                )  # fmt: skip
                name = next(n for n in metric_names(target["expr"]) if n.startswith(prefix))
                target["expr"] = target["expr"].replace(name, misspell(name), 1)
            else:
                query = next(
                    d["timeSeriesQuery"] for tile in c["mosaicLayout"]["tiles"]
                    for d in tile["widget"]["xyChart"]["dataSets"]
                    if any(n.startswith(prefix) for n in metric_names(d["timeSeriesQuery"]["prometheusQuery"]))
                )  # fmt: skip
                name = next(n for n in metric_names(query["prometheusQuery"]) if n.startswith(prefix))
                query["prometheusQuery"] = query["prometheusQuery"].replace(name, misspell(name), 1)
            problems = check_all(g, c, known)[0]
            wanted = [p for p in problems if f"unknown metric {misspell(name)}" in p]
            if not wanted:
                failures.append(f"self-test: {misspell(name)} in {which} was not reported")
    return failures


def main(argv):
    args = dict(zip(argv[1::2], argv[2::2])) if len(argv) > 1 else {}
    command = argv[0] if argv else "check"
    if command == "generate":
        GRAFANA.parent.mkdir(parents=True, exist_ok=True)
        CLOUD.parent.mkdir(parents=True, exist_ok=True)
        GRAFANA.write_text(dump(generate_grafana()))
        CLOUD.write_text(dump(generate_cloud()))
        print(f"wrote {GRAFANA.relative_to(ROOT)} and {CLOUD.relative_to(ROOT)}")
        return 0
    if command != "check":
        print(__doc__, file=sys.stderr)
        return 2
    grafana_path = Path(args.get("--grafana", GRAFANA))
    cloud_path = Path(args.get("--cloud-monitoring", CLOUD))
    exposed = exposed_names(Path(args.get("--exposed", EXPOSED)).read_text())
    known = exposed | google_names(GOOGLE.read_text())
    grafana = json.loads(grafana_path.read_text())
    cloud = json.loads(cloud_path.read_text())
    problems, q1, q2 = check_all(grafana, cloud, known)
    if grafana_path == GRAFANA and grafana_path.read_text() != dump(generate_grafana()):
        problems.append(f"{GRAFANA.relative_to(ROOT)} is not what `scripts/dashboards.py generate` writes")
    if cloud_path == CLOUD and cloud_path.read_text() != dump(generate_cloud()):
        problems.append(f"{CLOUD.relative_to(ROOT)} is not what `scripts/dashboards.py generate` writes")
    if not problems:
        problems += self_test(grafana, cloud, known)
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"dashboards: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    names = {n for qs in (q1, q2) for q in sum(qs.values(), []) for n in metric_names(q)}
    worker = sorted(n for n in names if n in exposed)
    print(
        f"dashboards: grafana {len(q1)} panels / {sum(map(len, q1.values()))} queries, "
        f"cloud monitoring {len(q2)} tiles / {sum(map(len, q2.values()))} queries, in parity; "
        f"{len(names)} metrics, {len(worker)} from the worker's /metrics and {len(names) - len(worker)} "
        f"from Google's list; a misspelt metric is caught"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
