"""Project invariants of the container and deployment files that no schema knows.

Called by scripts/validate-deploy.sh after the schema validators and linters:

    validate-deploy-policy.py docker ROOT             Dockerfile, .dockerignore, .cargo/config.toml vs the workspace
    validate-deploy-policy.py compose CONFIG.json     `docker compose config --format json` output
    validate-deploy-policy.py k8s RENDERED.yaml DIR   `kubectl kustomize DIR` output, and DIR itself

Prints one line per problem and exits 1 if there is any.
"""

import glob
import json
import os
import re
import sys
import tomllib

problems = []


def need(cond, msg):
    if not cond:
        problems.append(msg)
    return cond


# --- docker -------------------------------------------------------------------------------------


def dockerignore_rules(path):
    """(regex, exclude?) per line, in Docker's .dockerignore pattern language."""
    rules = []
    if not os.path.exists(path):
        return rules
    for line in open(path, encoding="utf-8"):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exclude = not line.startswith("!")
        pat = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        rx, i = "", 0
        while i < len(pat):
            c = pat[i]
            if pat.startswith("**/", i):
                rx, i = rx + "(?:.*/)?", i + 3
                continue
            if pat.startswith("**", i):
                rx, i = rx + ".*", i + 2
                continue
            if c == "*":
                rx += "[^/]*"
            elif c == "?":
                rx += "[^/]"
            elif c == "[":
                j = pat.find("]", i)
                rx, i = (rx + pat[i : j + 1], j) if j > 0 else (rx + re.escape(c), i)
            elif c == "\\" and i + 1 < len(pat):
                rx, i = rx + re.escape(pat[i + 1]), i + 1
            else:
                rx += re.escape(c)
            i += 1
        rules.append((re.compile(rx + "$"), exclude))
    return rules


def ignored(rules, rel):
    """Docker's rule: the last pattern matching the path or one of its parent folders decides."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    verdict = False
    for rx, exclude in rules:
        if any(rx.match(p) for p in prefixes):
            verdict = exclude
    return verdict


def workspace(root):
    cargo = tomllib.load(open(os.path.join(root, "Cargo.toml"), "rb"))
    ws = cargo.get("workspace", {})
    members = sorted({m for pat in ws.get("members", []) for m in glob.glob(pat, root_dir=root)})
    bins = {}
    for m in members:
        manifest = tomllib.load(open(os.path.join(root, m, "Cargo.toml"), "rb"))
        pkg = manifest["package"]
        names = [b["name"] for b in manifest.get("bin", [])]
        if pkg.get("autobins", True):
            if os.path.exists(os.path.join(root, m, "src/main.rs")):
                names.append(pkg["name"])
            names += [os.path.basename(p)[:-3] for p in glob.glob(os.path.join(root, m, "src/bin/*.rs"))]
        for n in names:
            bins[n] = m
    return ws, members, bins


def check_docker(root):
    ws, members, bins = workspace(root)
    rules = dockerignore_rules(os.path.join(root, ".dockerignore"))
    need(rules, ".dockerignore is missing or empty")
    keep = ["Cargo.toml", "Cargo.lock", ".cargo/config.toml"]
    for m in members:
        keep.append(f"{m}/Cargo.toml")
        for dirpath, _, files in os.walk(os.path.join(root, m, "src")):
            keep += [os.path.relpath(os.path.join(dirpath, f), root) for f in files]
        if os.path.exists(os.path.join(root, m, "build.rs")):
            keep.append(f"{m}/build.rs")
    for rel in keep:
        need(not ignored(rules, rel), f".dockerignore excludes {rel}, which the image build needs")
    for rel in ["target", "models", ".git", "engine/target", "models/x.gguf"]:
        need(ignored(rules, rel), f".dockerignore does not exclude {rel}")

    config = tomllib.load(open(os.path.join(root, ".cargo/config.toml"), "rb"))
    flags = config.get("target", {}).get("x86_64-unknown-linux-gnu", {}).get("rustflags", [])
    need("target-cpu=x86-64-v3" in " ".join(flags), ".cargo/config.toml no longer sets target-cpu=x86-64-v3")

    for path in sorted(glob.glob(os.path.join(root, "docker/Dockerfile*"))):
        name = os.path.relpath(path, root)
        text = open(path, encoding="utf-8").read()
        code = "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#"))
        need(not re.search(r"^\s*(ENV|ARG)\s+RUSTFLAGS\b", code, re.M),
             f"{name}: RUSTFLAGS would replace .cargo/config.toml's target-cpu")
        need(re.search(r"cargo build --release --locked", code), f"{name}: no `cargo build --release --locked`")
        need("CARGO_FEATURES" in code, f"{name}: the CARGO_FEATURES build argument is not used")
        m = re.search(r"^ARG RUST_VERSION=(\d+)\.(\d+)", code, re.M)
        want = tuple(int(x) for x in ws.get("package", {}).get("rust-version", "1.88").split(".")[:2])
        if need(m, f"{name}: no pinned `ARG RUST_VERSION=X.Y`"):
            have = (int(m.group(1)), int(m.group(2)))
            need(have >= max(want, (1, 88)), f"{name}: rust {have} is older than the workspace's {want} / 1.88")
        built = set()
        for loop in re.findall(r"for bin in ([^;]+);", code):
            built |= set(loop.split())
        copy_lines = " ".join(re.findall(r"^COPY --from=builder .*$", code, re.M))
        copied = set(re.findall(r"/out/([\w.-]+)", copy_lines))
        for b in sorted(built | copied):
            need(b in bins, f"{name}: installs {b}, but no workspace member builds a binary of that name "
                            f"(binaries: {', '.join(sorted(bins)) or 'none'})")
            need(b in built, f"{name}: copies {b} from the builder, which does not install it into /out")
        stages = re.split(r"^FROM\s+", code, flags=re.M)[1:]
        for stage in stages:
            head = stage.split("\n", 1)[0]
            target = head.split(" AS ")[-1].strip() if " AS " in head else None
            if target not in ("verifier", "gateway"):
                continue
            user = re.findall(r"^USER\s+(\S+)", stage, re.M)
            need(user and user[-1].split(":")[0] not in ("root", "0"), f"{name}: target {target} does not run as a non-root USER")
            need(re.search(r"^HEALTHCHECK .*/health", stage, re.M | re.S), f"{name}: target {target} has no HEALTHCHECK on /health")
            need(re.search(r"^EXPOSE\s+\d+", stage, re.M), f"{name}: target {target} has no EXPOSE")
            need(re.search(r"^ENTRYPOINT\s+\[", stage, re.M), f"{name}: target {target} has no exec-form ENTRYPOINT")
        for target in ("verifier", "gateway"):
            need(re.search(rf"^FROM\s+\S+\s+AS\s+{target}\s*$", code, re.M), f"{name}: no `{target}` target")


# --- compose ------------------------------------------------------------------------------------


def check_compose(path):
    cfg = json.load(open(path, encoding="utf-8"))
    svc = cfg.get("services", {})
    for name in ("verifier", "gateway", "link", "tls"):
        need(name in svc, f"compose: no service {name}")
    if not problems:
        v, g = svc["verifier"], svc["gateway"]
        need(not v.get("ports"), "compose: the verifier publishes ports to the host; it should be reachable on the compose network only")
        for p in g.get("ports", []):
            need(p.get("host_ip") == "127.0.0.1", f"compose: gateway port {p.get('published')} is published on {p.get('host_ip') or 'all interfaces'}, not 127.0.0.1")
        need(g.get("ports"), "compose: the gateway publishes no port")
        need(g.get("depends_on", {}).get("verifier", {}).get("condition") == "service_healthy",
             "compose: gateway must depend on verifier with condition service_healthy")
        for name in ("verifier", "gateway"):
            mounts = [m for m in svc[name].get("volumes", []) if m.get("target") == "/models"]
            need(mounts and all(m.get("read_only") for m in mounts), f"compose: {name} has no read-only /models volume")
            need("/health" in " ".join(svc[name].get("healthcheck", {}).get("test", [])), f"compose: {name} healthcheck does not hit /health")
            need(svc[name].get("build", {}).get("target") == name, f"compose: {name} does not build the `{name}` Dockerfile target")
        need("latency" in svc["link"].get("profiles", []), "compose: link is not in the `latency` profile")
        need("tls" in svc["tls"].get("profiles", []), "compose: tls is not in the `tls` profile")
        need(svc["link"].get("entrypoint", [""])[0].endswith("spade-delay-proxy"), "compose: link does not run spade-delay-proxy")


# --- kubernetes ---------------------------------------------------------------------------------


def check_k8s(path, folder):
    import yaml

    kustomization = yaml.safe_load(open(os.path.join(folder, "kustomization.yaml"), encoding="utf-8"))
    listed = set(kustomization.get("resources", []))
    for f in sorted(os.listdir(folder)):
        if f.endswith(".yaml") and f != "kustomization.yaml" and not f.endswith(".example.yaml"):
            need(f in listed, f"k8s: {folder}/{f} is not listed in kustomization.yaml resources (or name it *.example.yaml)")
    docs = [d for d in yaml.safe_load_all(open(path, encoding="utf-8")) if d]
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    need(not by_kind.get("Secret"), "k8s: a Secret is rendered; the API key must come from a Secret created outside git")
    deps = [d for d in by_kind.get("Deployment", []) if d["metadata"]["name"] == "spade-verifier"]
    svcs = [s for s in by_kind.get("Service", []) if s["metadata"]["name"] == "spade-verifier"]
    if not (need(deps, "k8s: no Deployment spade-verifier") and need(svcs, "k8s: no Service spade-verifier")):
        return
    dep, svc = deps[0], svcs[0]
    spec = dep["spec"]
    pod = spec["template"]["spec"]
    need(spec.get("replicas", 1) >= 2, "k8s: the verifier Deployment should run several replicas")
    need(pod.get("securityContext", {}).get("runAsNonRoot") is True, "k8s: pod securityContext.runAsNonRoot is not true")
    c = pod["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        need(c.get(probe, {}).get("httpGet", {}).get("path") == "/health", f"k8s: {probe} is not an HTTP GET on /health")
    csc = c.get("securityContext", {})
    need(csc.get("allowPrivilegeEscalation") is False, "k8s: container allows privilege escalation")
    need("ALL" in csc.get("capabilities", {}).get("drop", []), "k8s: container does not drop ALL capabilities")
    res = c.get("resources", {})
    need(res.get("requests") and res.get("limits"), "k8s: container has no resource requests and limits")
    env = {e["name"]: e for e in c.get("env", [])}
    need("secretKeyRef" in env.get("SPADE_VERIFIER_API_KEY", {}).get("valueFrom", {}), "k8s: SPADE_VERIFIER_API_KEY does not come from a Secret")
    need(env.get("SPADE_VERIFIER_HOST", {}).get("value") == "0.0.0.0", "k8s: SPADE_VERIFIER_HOST is not 0.0.0.0 (the Service could not reach it)")
    mounts = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/models"]
    need(mounts and all(m.get("readOnly") for m in mounts), "k8s: /models is not mounted read-only")
    labels = spec["template"]["metadata"]["labels"]
    need(all(labels.get(k) == v for k, v in svc["spec"]["selector"].items()), "k8s: the Service selector does not match the pod labels")
    need(all(labels.get(k) == v for k, v in spec["selector"]["matchLabels"].items()), "k8s: the Deployment selector does not match its pod labels")
    need(svc["spec"].get("sessionAffinity") == "ClientIP", "k8s: the Service has no sessionAffinity: ClientIP")
    port_names = {p.get("name") for p in c.get("ports", [])} | {p["containerPort"] for p in c.get("ports", [])}
    for p in svc["spec"]["ports"]:
        need(p.get("targetPort") in port_names, f"k8s: Service targetPort {p.get('targetPort')} is not a container port")
    for hpa in by_kind.get("HorizontalPodAutoscaler", []):
        need(hpa["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"], "k8s: the HPA targets another Deployment")
    for pdb in by_kind.get("PodDisruptionBudget", []):
        need(all(labels.get(k) == v for k, v in pdb["spec"]["selector"]["matchLabels"].items()), "k8s: the PDB selector does not match the pods")
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes", []) if "persistentVolumeClaim" in v}
    rendered_claims = {p["metadata"]["name"] for p in by_kind.get("PersistentVolumeClaim", [])}
    need(claims <= rendered_claims, f"k8s: PVC(s) {sorted(claims - rendered_claims)} used but not defined")


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    {"docker": check_docker, "compose": check_compose, "k8s": check_k8s}[what](*args)
    for p in problems:
        print(p)
    sys.exit(1 if problems else 0)
