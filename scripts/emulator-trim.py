#!/usr/bin/env python3
"""The Pub/Sub emulator's jar cut to what it runs, for `scripts/pubsub-emulator.sh pack`.

gcloud's emulator jar (0.8.20) bundles 33,472 files, 182 MB unpacked, 27 MB under xz: clients
of a dozen Google APIs and native libraries for five platforms. A GPU machine that runs
bench/gpu_job.py's job gets the repository, the worker and the emulator in 64 MB, so the jar
travels with the packages the emulator loaded classes from in a traced run (every class of
each such package, not only those loaded), Linux x86-64's native libraries and every other
resource: 7.9 MB under xz. CI runs that job on the cut jar (bench/gpu-check.sh), so a class the
cut left out fails there, not on the GPU machine.

    python3 scripts/emulator-trim.py packages LOG > scripts/emulator-fix/packages.txt
    python3 scripts/emulator-trim.py cut JAR PACKAGES OUT.jar

LOG is the emulator's class-load log over a whole job, e.g.
    JAVA_TOOL_OPTIONS=-Xlog:class+load=info:file=LOG python3 bench/gpu_job.py …
with the emulator not already running (the job starts it). Service files (META-INF/services)
keep the providers that remain. The jar is written uncompressed: xz packs it better so.
"""
import re
import sys
import zipfile


def packages(log):
    """Packages of the classes a class-load log read from a jar or a folder (not the JDK's)."""
    names = set()
    for line in open(log):
        m = re.search(r"\] (\S+) source: (?:file|jar):", line)
        if m:
            cls = m.group(1).split("$")[0]
            names.add(cls.rsplit(".", 1)[0] if "." in cls else "")
    return sorted(names)


def cut(jar, listing, out):
    keep = {line.strip().replace(".", "/") for line in open(listing) if line.strip()}
    with zipfile.ZipFile(jar) as src:
        entries = [e for e in src.infolist() if not e.is_dir()]

        def wanted(name):
            folder = name.rsplit("/", 1)[0] if "/" in name else ""
            if name.endswith(".class"):
                return folder in keep
            if folder == "META-INF/native":  # Linux x86-64's (epoll's has no "linux" in its name)
                return name.endswith(".so") and re.search(r"x86_64", name) is not None
            return True

        kept = {e.filename for e in entries if wanted(e.filename)}
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
            for e in entries:
                if e.filename not in kept:
                    continue
                data = src.read(e)
                if e.filename.startswith("META-INF/services/"):
                    lines = [p for p in data.decode().splitlines()
                             if p.strip() and not p.startswith("#")
                             and p.strip().replace(".", "/") + ".class" in kept]
                    if not lines:
                        continue
                    data = ("\n".join(lines) + "\n").encode()
                dst.writestr(e.filename, data)
    print(f"{out}: {len(kept)} of {len(entries)} files", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "packages":
        print("\n".join(packages(sys.argv[2])))
    elif len(sys.argv) == 5 and sys.argv[1] == "cut":
        cut(*sys.argv[2:])
    else:
        raise SystemExit(__doc__)
