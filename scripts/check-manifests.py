#!/usr/bin/env python3
"""Checks a rendered kustomization for the mistakes schemas cannot see.

- every workload that selects Spot or flex-start nodes tolerates the matching taint
  (a taint/selector mismatch leaves pods Pending forever);
- terminationGracePeriodSeconds covers the worker's SPOTINFER_SHUTDOWN_TIMEOUT with room to spare,
  and stays within Spot's ~15 s for non-system pods;
- containers run as non-root with a read-only root filesystem, request a priority class, and
  (Deployments) have liveness and readiness probes;
- no literal secret values: DATABASE_URL comes from a Secret;
- every worker (`work`) limits the buckets a record's `uri` may name (SPOTINFER_ALLOWED_BUCKETS
  or --allowed-buckets, not empty): unset, it reads any object its service account can;
- a Job in job mode (SPOTINFER_EXIT_WHEN_JOB_COMPLETE) replaces a worker that exits 75 (stopped
  before the job was complete) without spending backoffLimit, and fails on 66 (no worker can
  make progress);
- the taint watch (SPOTINFER_EARLY_DRAIN=taint) has its API token and NODE_NAME;
- a NetworkPolicy limits who can reach the workers' metrics port.
"""
import re
import sys

import yaml

TAINTED_SELECTORS = {
    "cloud.google.com/gke-spot": "cloud.google.com/gke-spot",
    "cloud.google.com/gke-flex-start": "cloud.google.com/gke-flex-start",
}


def seconds(v):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", str(v))
    if not m:
        raise ValueError(f"unparsed duration {v!r}")
    n, unit = float(m.group(1)), m.group(2)
    return n / 1000 if unit == "ms" else n * 60 if unit == "m" else n


def is_worker(container):
    """Whether the container runs `spotinfer work`."""
    return "work" in container.get("args", []) + container.get("command", [])


def allowed_buckets(container, configmaps):
    """The worker's --allowed-buckets as the manifest sets it (flag, env, or a ConfigMap the
    container takes its environment from), or "" when it sets none."""
    args = container.get("args", []) + container.get("command", [])
    for i, a in enumerate(args):
        if a.startswith("--allowed-buckets="):
            return a.split("=", 1)[1].strip()
        if a == "--allowed-buckets" and i + 1 < len(args):
            return args[i + 1].strip()
    value = ""
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef", {}).get("name")
        value = configmaps.get(ref, {}).get("SPOTINFER_ALLOWED_BUCKETS", value)
    for e in container.get("env", []):
        if e["name"] == "SPOTINFER_ALLOWED_BUCKETS":
            value = e.get("value", "set elsewhere" if "valueFrom" in e else "")
    return str(value).strip()


def main(path):
    docs = [d for d in yaml.safe_load_all(open(path)) if d]
    configmaps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    config = {}
    for d in docs:
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("spotinfer"):
            config.update(d.get("data", {}))
    problems = []
    if not any(d["kind"] == "NetworkPolicy" and "Ingress" in d["spec"].get("policyTypes", []) for d in docs):
        problems.append("no NetworkPolicy restricts ingress to the workers (their /metrics is unauthenticated)")
    taint_watch = "taint" in [w.strip() for w in str(config.get("SPOTINFER_EARLY_DRAIN", "off")).split(",")]
    for d in docs:
        if d["kind"] not in ("Deployment", "Job"):
            continue
        name = f'{d["kind"]}/{d["metadata"]["name"]}'
        pod = d["spec"]["template"]["spec"]
        tolerated = {t.get("key") for t in pod.get("tolerations", [])}
        for sel, taint in TAINTED_SELECTORS.items():
            if sel in pod.get("nodeSelector", {}) and taint not in tolerated:
                problems.append(f"{name}: selects {sel} but does not tolerate the {taint} taint")
        grace = pod.get("terminationGracePeriodSeconds", 30)
        budget = seconds(config.get("SPOTINFER_SHUTDOWN_TIMEOUT", "8s"))
        if grace < budget + 2:
            problems.append(f"{name}: grace period {grace}s leaves no room over the {budget}s shutdown budget")
        if "cloud.google.com/gke-spot" in pod.get("nodeSelector", {}) and grace > 15:
            problems.append(f"{name}: Spot gives non-system pods about 15 s; grace period is {grace}s")
        if taint_watch:
            if pod.get("automountServiceAccountToken") is False:
                problems.append(f"{name}: the taint watch (SPOTINFER_EARLY_DRAIN) needs the service-account token")
            if not any(e["name"] == "NODE_NAME" for c in pod["containers"] for e in c.get("env", [])):
                problems.append(f"{name}: the taint watch (SPOTINFER_EARLY_DRAIN) needs NODE_NAME")
        if d["kind"] == "Job" and config.get("SPOTINFER_EXIT_WHEN_JOB_COMPLETE"):
            rules = d["spec"].get("podFailurePolicy", {}).get("rules", [])

            def first_action(code):
                for r in rules:
                    if code in r.get("onExitCodes", {}).get("values", []) and r["onExitCodes"].get("operator") == "In":
                        return r["action"]
                return None

            if first_action(75) != "Ignore":
                problems.append(f"{name}: podFailurePolicy must Ignore exit code 75 (stopped before the job was complete: replace the pod)")
            if first_action(66) != "FailJob":
                problems.append(f"{name}: podFailurePolicy must FailJob on exit code 66 (no worker can make progress on the job)")
            if pod.get("restartPolicy") != "Never":
                problems.append(f"{name}: podFailurePolicy needs restartPolicy: Never")
        if not pod.get("priorityClassName"):
            problems.append(f"{name}: no priorityClassName")
        if not pod.get("securityContext", {}).get("runAsNonRoot"):
            problems.append(f"{name}: pod does not set runAsNonRoot")
        for c in pod["containers"]:
            if is_worker(c) and not allowed_buckets(c, configmaps):
                problems.append(
                    f"{name}/{c['name']}: the worker does not set SPOTINFER_ALLOWED_BUCKETS (--allowed-buckets): "
                    "a record's uri could name any bucket its service account can read"
                )
            sc = c.get("securityContext", {})
            if not sc.get("readOnlyRootFilesystem"):
                problems.append(f"{name}/{c['name']}: root filesystem is writable")
            if d["kind"] == "Deployment" and not (c.get("livenessProbe") and c.get("readinessProbe")):
                problems.append(f"{name}/{c['name']}: missing liveness or readiness probe")
            for e in c.get("env", []):
                if e["name"] == "DATABASE_URL" and "value" in e:
                    problems.append(f"{name}/{c['name']}: DATABASE_URL is a literal; use a Secret")
    if problems:
        print("\n".join(problems))
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1])
