#!/usr/bin/env python3
"""Evaluates every query of the Grafana dashboard against a Prometheus (its HTTP API,
/api/v1/query_range) over the time of a load test run, saves the results, and draws each panel,
with the run's faults marked, into one image. Run by scripts/dashboard-demo.sh.

  dashboard-snapshot.py --prometheus URL --report loadtest-report.json
      --dashboard dashboards/grafana/spotinfer.json --queries OUT.json --image OUT.png
      [--summary OUT.json] [--step SECONDS]

Grafana's variables are given the values Grafana would: $__rate_interval is four scrape
intervals (the demo scrapes every second: 4s), $subscription its default. Needs matplotlib (the
demo script installs it into .cache/dashboard-venv); the queries and their results need nothing.
"""

import argparse
import json
import re
import time
import urllib.parse
import urllib.request

# Metrics that only Google Cloud has: empty here by nature, said so on the panel.
GOOGLE_ONLY = ("pubsub_googleapis_com:", "kubernetes_io:")


def evaluate(prometheus, expr, start, end, step):
    url = f"{prometheus}/api/v1/query_range?" + urllib.parse.urlencode(
        {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": str(step)}
    )
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:
        body = json.load(e)
    return body


def legend(fmt, labels):
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) or str(labels)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prometheus", required=True)
    ap.add_argument("--report", required=True)
    ap.add_argument("--dashboard", required=True)
    ap.add_argument("--queries", required=True)
    ap.add_argument("--summary")
    ap.add_argument("--image", required=True)
    ap.add_argument("--step", type=float, default=1.0)
    ap.add_argument("--rate-interval", default="4s")
    a = ap.parse_args()

    report = json.load(open(a.report))
    dashboard = json.load(open(a.dashboard))
    timeline = report["timeline"]
    t0 = timeline["started_unix"]
    start, end = t0 - 2, min(time.time(), t0 + report["processing_seconds"] + 15)
    variables = {v["name"]: v.get("query", "") for v in dashboard["templating"]["list"]}
    results = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", a.rate_interval)
            expr = re.sub(r"\$(\w+)", lambda m: variables.get(m.group(1), m.group(0)), expr)
            body = evaluate(a.prometheus, expr, start, end, a.step)
            series = body.get("data", {}).get("result", []) if body.get("status") == "success" else []
            results.append(
                {
                    "panel": panel["title"],
                    "refId": target["refId"],
                    "expr": target["expr"],
                    "evaluated": expr,
                    "legendFormat": target.get("legendFormat", ""),
                    "status": body.get("status"),
                    "error": body.get("error"),
                    "series": len(series),
                    "samples": sum(len(s["values"]) for s in series),
                    "result": series,
                }
            )
    json.dump(
        {"prometheus": a.prometheus, "start": start, "end": end, "step": a.step, "queries": results},
        open(a.queries, "w"),
        indent=1,
    )
    summary = []
    for r in results:
        values = [float(v[1]) for s in r["result"] for v in s["values"] if v[1] not in ("NaN", "+Inf", "-Inf")]
        summary.append(
            {
                k: r[k]
                for k in ("panel", "refId", "expr", "evaluated", "status", "error", "series", "samples")
            }
            | ({"max": round(max(values), 4)} if values else {})
        )
    if a.summary:
        json.dump(
            {"start": start, "end": end, "step": a.step, "queries": summary},
            open(a.summary, "w"),
            indent=1,
        )
        open(a.summary, "a").write("\n")
    ok = sum(r["status"] == "success" for r in results)
    with_data = sum(r["samples"] > 0 for r in results)
    print(
        f"{len(results)} queries evaluated over {end - start:.0f} s: {ok} accepted by Prometheus, "
        f"{with_data} with data, {sum(r['samples'] for r in results)} samples in all"
    )
    for r in results:
        if r["status"] != "success":
            print(f"  ERROR {r['panel']} {r['refId']}: {r['error']}")
        elif not r["samples"]:
            print(f"  no data: {r['panel']} {r['refId']}: {r['evaluated']}")
    draw(dashboard, results, timeline, start, end, t0, a.image, report)


def draw(dashboard, results, timeline, start, end, t0, image, report):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in dashboard["panels"] if p.get("type") != "row"]
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(13, 2.55 * rows), sharex=True)
    faults = {
        "sigterm": ("#e67800", "SIGTERM"),
        "sigkill": ("#c80000", "SIGKILL"),
        "database_outage": ("#7800a0", "database outage"),
        "streams_dropped": ("#006e96", "streams dropped"),
    }
    for ax, panel in zip(axes.flat, panels):
        mine = [r for r in results if r["panel"] == panel["title"]]
        drawn = 0
        for r in mine:
            for s in r["result"]:
                xs = [float(v[0]) - t0 for v in s["values"]]
                ys = [float(v[1]) if v[1] not in ("NaN",) else float("nan") for v in s["values"]]
                ax.plot(xs, ys, linewidth=1.4, label=legend(r["legendFormat"], s["metric"]))
                drawn += 1
        google = [r for r in mine if not r["samples"] and any(g in r["evaluated"] for g in GOOGLE_ONLY)]
        if google:
            ax.text(
                0.5,
                0.5 if not drawn else 0.06,
                "no data here: Google Cloud's metric"
                + ("s" if len(google) > 1 else "")
                + " (the emulator and a local cluster export none)",
                transform=ax.transAxes,
                ha="center",
                va="center",
                fontsize=8,
                color="#666666",
            )
        for e in timeline["events"]:
            if e["kind"] in faults:
                ax.axvline(e["seconds"], color=faults[e["kind"]][0], alpha=0.35, linewidth=0.8)
        unit = panel["fieldConfig"]["defaults"].get("custom", {}).get("axisLabel") or panel[
            "fieldConfig"
        ]["defaults"].get("unit", "")
        ax.set_title(panel["title"], fontsize=10, loc="left")
        ax.set_ylabel({"s": "seconds", "short": "count"}.get(unit, unit), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.25)
        ax.set_xlim(start - t0, end - t0)
        ax.set_ylim(bottom=0)
        if drawn:
            ax.legend(fontsize=7, loc="upper right", ncol=3, framealpha=0.8)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("seconds since the first worker start (vertical lines: faults)", fontsize=8)
    fig.suptitle(
        f"{dashboard['title']}: every query evaluated by Prometheus over a spotinfer loadtest run "
        f"({report['workers']} workers, {report['sigterms']} SIGTERM, {report['sigkills']} SIGKILL, "
        f"{report['db_outages']} database outage, {report['stream_drops']} stream drops)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(image, dpi=72)


if __name__ == "__main__":
    main()
