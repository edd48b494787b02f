//! The shipped manifests and the lint that guards them (scripts/check-manifests.py, run by
//! scripts/lint-deploy.sh): every kustomization passes, and a worker that leaves out a setting
//! the lint requires is refused with a message naming it. Needs `kubectl` (kustomize) and a
//! `python3` with PyYAML, as the lint does.

use std::path::Path;
use std::process::Command;

const KUSTOMIZATIONS: [&str; 3] = ["k8s/base", "k8s/overlays/gpu", "k8s/overlays/flex-start"];

/// The kustomization rendered as `kubectl kustomize` renders it for the lint.
fn render(kustomization: &str) -> String {
    let out = Command::new("kubectl")
        .args(["kustomize", kustomization])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("kubectl (for kustomize) is needed, as scripts/lint-deploy.sh needs it");
    assert!(out.status.success(), "{kustomization}: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// The lint's verdict on a rendered manifest: whether it passed, and what it printed.
fn check(rendered: &str, dir: &Path) -> (bool, String) {
    let file = dir.join("rendered.yaml");
    std::fs::write(&file, rendered).unwrap();
    let out = Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/check-manifests.py"))
        .arg(&file)
        .output()
        .expect("python3 with PyYAML is needed, as scripts/check-manifests.py needs it");
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), said)
}

/// Issue 40: the manifests left `--allowed-buckets` unset, so whoever could publish could make
/// the workers read any object their service account can. Each shipped worker sets it, and the
/// lint refuses a manifest whose worker does not.
#[test]
fn every_worker_is_limited_to_its_buckets_and_the_lint_refuses_one_that_is_not() {
    let dir = tempfile::tempdir().unwrap();
    for k in KUSTOMIZATIONS {
        let rendered = render(k);
        let (ok, said) = check(&rendered, dir.path());
        assert!(ok, "{k}: the shipped manifest fails the lint: {said}");
        assert!(rendered.contains("SPOTINFER_ALLOWED_BUCKETS"), "{k}");
        let without: String = rendered
            .lines()
            .filter(|l| !l.contains("SPOTINFER_ALLOWED_BUCKETS"))
            .map(|l| format!("{l}\n"))
            .collect();
        let (ok, said) = check(&without, dir.path());
        assert!(
            !ok,
            "{k}: a worker without SPOTINFER_ALLOWED_BUCKETS passed the lint"
        );
        assert!(
            said.contains("does not set SPOTINFER_ALLOWED_BUCKETS"),
            "{k}: unclear message: {said}"
        );
        let empty = rendered.replace(
            "SPOTINFER_ALLOWED_BUCKETS: INPUT_BUCKET",
            "SPOTINFER_ALLOWED_BUCKETS: \"\"",
        );
        assert_ne!(empty, rendered, "{k}: the placeholder moved");
        let (ok, said) = check(&empty, dir.path());
        assert!(
            !ok,
            "{k}: an empty SPOTINFER_ALLOWED_BUCKETS passed the lint: {said}"
        );
    }
}
