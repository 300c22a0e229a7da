"""Project invariants of the container and deployment files that no schema knows.

Called by scripts/validate-deploy.sh after the schema validators and linters:

    validate-deploy-policy.py docker ROOT             Dockerfile, .dockerignore, .cargo/config.toml vs the workspace
    validate-deploy-policy.py compose CONFIG.json     `docker compose config --format json` output
    validate-deploy-policy.py nginx CONF CONFIG.json  deploy/nginx's config, and the compose services it names
    validate-deploy-policy.py caddy ADAPTED.json N    `caddy adapt` output of the Caddyfile with N upstreams
    validate-deploy-policy.py k8s RENDERED.yaml DIR   `kubectl kustomize DIR` output, and DIR itself

Several verifier replicas must be reached through a hash of the gateway's affinity header (its name
is read from core/src/protocol.rs, AFFINITY_HEADER), so that a conversation keeps reaching the
replica that holds its prefix cache: the nginx upstream hash, Caddy's header policy, the Ingress's
upstream-hash-by annotation.

Health checks: whatever waits for a server or routes to it (HEALTHCHECK, compose healthchecks and
depends_on, Caddy's active checks, startup and readiness probes) asks /health/ready (/health is the
same); only the Kubernetes liveness probe asks /health/live, which is 200 while the model still
loads, so that a replica is restarted when its scoring thread dies, never for being busy or loading.
A NetworkPolicy admits only gateways and the ingress controller to the verifier's port.

Prints one line per problem and exits 1 if there is any.
"""

import glob
import json
import os
import re
import sys
import tomllib

problems = []
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The verifier's own request body limit (--max-body-bytes default); a proxy must allow as much.
BODY_BYTES = 8 << 20
# How long a proxy must wait for a verify: a long prompt's prefill can take minutes on CPU.
READ_SECS = 600
# When an nginx proxy must try the next replica. A replica that restarts listens at once and answers
# 503 while its model loads; without non_idempotent nginx would pass that 503 for every POST /verify
# (and not even count it as a failure), so its conversations would fail instead of moving.
FAILOVER = {"error", "timeout", "http_503", "non_idempotent"}
FAILOVER_WHY = "a dead or loading replica must cost a re-prefill on the next one, not an error"
# Readiness (200 once the model is loaded; /health is the same route) and liveness paths of both servers.
READY = ("/health/ready", "/health")
LIVE = "/health/live"
READY_WHY = "must check readiness (/health/ready), not liveness: /health/live is 200 while the model still loads"
# The pod labels of in-cluster gateways, which the verifier's NetworkPolicy admits.
GATEWAY_LABELS = {"app.kubernetes.io/name": "spade-gateway"}
# The namespace of the ingress controller verifier-ingress.yaml is written for (class nginx).
INGRESS_NAMESPACE = "ingress-nginx"


def need(cond, msg):
    if not cond:
        problems.append(msg)
    return cond


def affinity_header():
    """The header the gateway sends (spade-core's AFFINITY_HEADER), lower case."""
    path = os.path.join(ROOT, "core/src/protocol.rs")
    m = re.search(r'pub const AFFINITY_HEADER: &str = "([^"]+)"', open(path, encoding="utf-8").read())
    if not need(m, "core/src/protocol.rs: no `pub const AFFINITY_HEADER: &str = \"...\"` to check the proxies against"):
        return "x-spade-affinity"
    return m.group(1).lower()


def nginx_var(header):
    """nginx's variable for a request header: $http_ + lower case, '-' as '_'."""
    return "$http_" + header.lower().replace("-", "_")


def url_paths(text):
    """The paths of the http(s) URLs in a health check command, e.g. ['/health/ready']."""
    return re.findall(r"https?://[^/\s\"']+(/[^\s\"'|;]*)", text)


def ready_check(text):
    """Whether a health check command asks a readiness path, and nothing else."""
    paths = url_paths(text)
    return bool(paths) and all(p in READY for p in paths)


def size_bytes(v):
    """An nginx / ingress-nginx size ("8m", "1024k", "8388608") in bytes; None if unreadable."""
    m = re.fullmatch(r"(\d+)([kKmMgG]?)", str(v).strip())
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()] if m else None


def seconds(v):
    """An nginx time ("600s", "10m", "600") in seconds; None if unreadable."""
    m = re.fullmatch(r"(\d+)(ms|s|m|h)?", str(v).strip())
    return int(m.group(1)) * {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600}[m.group(2)] if m else None


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
            check = re.search(r"^HEALTHCHECK (?:.*\\\n)*.*$", stage, re.M)
            need(check and ready_check(check.group(0)), f"{name}: target {target} has no HEALTHCHECK on /health/ready or /health; it {READY_WHY}")
            need(re.search(r"^EXPOSE\s+\d+", stage, re.M), f"{name}: target {target} has no EXPOSE")
            need(re.search(r"^ENTRYPOINT\s+\[", stage, re.M), f"{name}: target {target} has no exec-form ENTRYPOINT")
        for target in ("verifier", "gateway"):
            need(re.search(rf"^FROM\s+\S+\s+AS\s+{target}\s*$", code, re.M), f"{name}: no `{target}` target")


# --- compose ------------------------------------------------------------------------------------


def check_compose(path):
    cfg = json.load(open(path, encoding="utf-8"))
    svc = cfg.get("services", {})
    for name in ("verifier", "gateway", "link", "tls", "verifier-b", "lb"):
        need(name in svc, f"compose: no service {name} (render with every profile)")
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
            need(ready_check(" ".join(svc[name].get("healthcheck", {}).get("test", []))),
                 f"compose: {name} healthcheck does not hit /health/ready; it {READY_WHY}")
            need(svc[name].get("build", {}).get("target") == name, f"compose: {name} does not build the `{name}` Dockerfile target")
        need("latency" in svc["link"].get("profiles", []), "compose: link is not in the `latency` profile")
        need("tls" in svc["tls"].get("profiles", []), "compose: tls is not in the `tls` profile")
        need(svc["link"].get("entrypoint", [""])[0].endswith("spade-delay-proxy"), "compose: link does not run spade-delay-proxy")
        check_compose_replicas(svc)


def check_compose_replicas(svc):
    """Profile `replicas`: a second verifier exactly like the first, and the nginx load balancer."""
    v, b, lb = svc["verifier"], svc["verifier-b"], svc["lb"]
    need("replicas" in b.get("profiles", []), "compose: verifier-b is not in the `replicas` profile")
    need("replicas" in lb.get("profiles", []), "compose: lb is not in the `replicas` profile")
    for key in ("image", "environment", "volumes", "healthcheck", "expose", "restart"):
        need(b.get(key) == v.get(key), f"compose: verifier-b's {key} differs from verifier's; the replicas must be alike")
    need(not b.get("ports"), "compose: verifier-b publishes ports to the host")
    need(not lb.get("ports"), "compose: lb publishes ports to the host; like the verifier it is for the compose network")
    image = lb.get("image", "")
    need(re.fullmatch(r"nginx:\d+\.\d+[\w.-]*", image), f"compose: lb image {image!r} is not an nginx image pinned to a version")
    conf = [m for m in lb.get("volumes", []) if m.get("target") == "/etc/nginx/nginx.conf"]
    need(conf and all(m.get("read_only") and m.get("source", "").endswith("/deploy/nginx/nginx.conf") for m in conf),
         "compose: lb does not mount deploy/nginx/nginx.conf read-only at /etc/nginx/nginx.conf")
    need(ready_check(" ".join(lb.get("healthcheck", {}).get("test", []))), f"compose: lb healthcheck does not hit /health/ready; it {READY_WHY}")
    for name in ("verifier", "verifier-b"):
        need(name in lb.get("depends_on", {}), f"compose: lb does not depend on {name}")
    dep = svc["gateway"].get("depends_on", {}).get("lb", {})
    need(dep.get("condition") == "service_healthy" and dep.get("required") is False,
         "compose: gateway should wait for lb (service_healthy, required: false) when the `replicas` profile runs it")


# --- nginx --------------------------------------------------------------------------------------


def nginx_parse(text):
    """nginx.conf as a tree: [(directive, [args], children or None)]. Enough of the grammar for a
    hand-written file: comments, quotes, blocks (nginx -t checks the real grammar)."""
    tokens = re.findall(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|#[^\n]*|[{};]|[^\s{};"\'#]+', text)
    tokens = [t[1:-1] if t[:1] in "\"'" else t for t in tokens if not t.startswith("#")]
    pos = 0

    def block():
        nonlocal pos
        out, words = [], []
        while pos < len(tokens):
            t = tokens[pos]
            pos += 1
            if t == ";":
                if words:
                    out.append((words[0], words[1:], None))
                words = []
            elif t == "{":
                children = block()
                out.append((words[0], words[1:], children))
                words = []
            elif t == "}":
                return out
            else:
                words.append(t)
        return out

    return block()


def nginx_find(tree, name):
    return [d for d in tree if d[0] == name]


def nginx_setting(chain, name):
    """The value of `name` in the innermost of the nested blocks `chain` (outermost first) that sets it."""
    for tree in reversed(chain):
        found = nginx_find(tree, name)
        if found:
            return found[-1][1]
    return None


def check_nginx(conf, compose_json):
    name = os.path.relpath(conf, ROOT)
    var = nginx_var(affinity_header())
    tree = nginx_parse(open(conf, encoding="utf-8").read())
    https = nginx_find(tree, "http")
    if not need(https and https[0][2] is not None, f"{name}: no http block"):
        return
    http = https[0][2]
    svc = json.load(open(compose_json, encoding="utf-8")).get("services", {})
    lb = svc.get("lb", {})
    mounted = any(os.path.realpath(m.get("source", "")) == os.path.realpath(conf) for m in lb.get("volumes", []))
    need(mounted, f"{name}: not the file the compose service lb mounts")

    upstreams = {u[1][0]: u[2] for u in nginx_find(http, "upstream") if u[1] and u[2] is not None}
    hashed = {u for u, body in upstreams.items() if any(d[1] == [var, "consistent"] for d in nginx_find(body, "hash"))}
    need(hashed, f"{name}: no upstream with `hash {var} consistent;`: the verifier replicas must be chosen by the "
                 f"gateway's affinity header, consistently, so that a conversation keeps its replica")
    verifier_image = svc.get("verifier", {}).get("image")
    replicas = {n for n, s in svc.items() if s.get("image") == verifier_image}
    for u in sorted(hashed):
        servers = nginx_find(upstreams[u], "server")
        need(len(servers) >= 2, f"{name}: upstream {u} has fewer than two servers")
        named = set()
        for d in servers:
            host, _, port = d[1][0].rpartition(":")
            named.add(host)
            need(host in replicas and port == "8081", f"{name}: upstream {u} server {d[1][0]} is not a verifier replica of "
                                                      f"compose ({', '.join(sorted(replicas))}) on port 8081")
            opts = dict(a.split("=", 1) for a in d[1][1:] if "=" in a)
            need("max_fails" in opts and "fail_timeout" in opts, f"{name}: upstream {u} server {d[1][0]} has no max_fails/fail_timeout")
        need(named >= replicas, f"{name}: upstream {u} leaves out the compose replica(s) {', '.join(sorted(replicas - named))}")
        need(nginx_find(upstreams[u], "keepalive"), f"{name}: upstream {u} keeps no idle connections (keepalive)")

    lb_ports = {str(p) for p in lb.get("expose", [])}
    proxied = 0
    for server in (d[2] for d in nginx_find(http, "server") if d[2] is not None):
        listens = {a[0].rpartition(":")[2] for _, a, _ in nginx_find(server, "listen")}
        need(listens & lb_ports, f"{name}: a server listens on {sorted(listens)}, none of which lb exposes ({sorted(lb_ports)})")
        for loc in (d[2] for d in nginx_find(server, "location") if d[2] is not None):
            target = (nginx_setting([loc], "proxy_pass") or [""])[0]
            if target.split("://", 1)[-1].rstrip("/") not in hashed:
                continue
            proxied += 1
            chain = [http, server, loc]
            where = f"{name}: the location proxying to {target}"
            need(nginx_setting(chain, "proxy_http_version") == ["1.1"], f"{where} does not use proxy_http_version 1.1 (needed for upstream keepalive)")
            headers = [a for t in chain for d, a, _ in nginx_find(t, "proxy_set_header") if a[:1] == ["Connection"]]
            need(["Connection", ""] in headers, f'{where} does not clear the Connection header (proxy_set_header Connection "")')
            nxt = nginx_setting(chain, "proxy_next_upstream") or ["error", "timeout"]
            need(FAILOVER <= set(nxt), f"{where}: proxy_next_upstream {' '.join(nxt)} lacks {' '.join(sorted(FAILOVER - set(nxt)))}; {FAILOVER_WHY}")
            body = size_bytes((nginx_setting(chain, "client_max_body_size") or ["1m"])[0])
            need(body is not None and (body == 0 or body >= BODY_BYTES), f"{where}: client_max_body_size is below the verifier's 8 MiB")
            read = seconds((nginx_setting(chain, "proxy_read_timeout") or ["60s"])[0])
            need(read is not None and read >= READ_SECS, f"{where}: proxy_read_timeout is under {READ_SECS} s; a long verify would be cut")
    need(proxied, f"{name}: no location proxies to a hashed upstream")


# --- caddy --------------------------------------------------------------------------------------


def check_caddy(adapted, upstreams):
    header = affinity_header()

    def proxies(o):
        if isinstance(o, dict):
            if o.get("handler") == "reverse_proxy":
                yield o
            for v in o.values():
                yield from proxies(v)
        elif isinstance(o, list):
            for v in o:
                yield from proxies(v)

    found = list(proxies(json.load(open(adapted, encoding="utf-8"))))
    if not need(found, "caddy: the adapted Caddyfile has no reverse_proxy"):
        return
    for p in found:
        need(len(p.get("upstreams", [])) == int(upstreams), f"caddy: reverse_proxy has {len(p.get('upstreams', []))} upstreams, expected {upstreams} from SPADE_TLS_UPSTREAMS")
        policy = p.get("load_balancing", {}).get("selection_policy", {})
        need(policy.get("policy") == "header" and policy.get("field", "").lower() == header,
             f"caddy: reverse_proxy does not choose its upstream by the {header} header (lb_policy header)")
        need(p.get("health_checks", {}).get("active", {}).get("uri") in READY, f"caddy: reverse_proxy does not health-check /health/ready; it {READY_WHY}")


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
    for probe in ("startupProbe", "readinessProbe"):
        need(c.get(probe, {}).get("httpGet", {}).get("path") in READY, f"k8s: {probe} is not an HTTP GET on /health/ready; it {READY_WHY}")
    need(c.get("livenessProbe", {}).get("httpGet", {}).get("path") == LIVE,
         f"k8s: livenessProbe is not an HTTP GET on {LIVE}: on readiness, a replica would be restarted for being busy or not ready")
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
    need(svc["spec"].get("sessionAffinity", "None") == "None",
         "k8s: the Service has sessionAffinity: it would pin whole gateways to replicas; the Ingress hashes each conversation instead")
    check_ingress(by_kind.get("Ingress", []), svc)
    port_names = {p.get("name") for p in c.get("ports", [])} | {p["containerPort"] for p in c.get("ports", [])}
    check_network_policy(by_kind.get("NetworkPolicy", []), labels, port_names)
    for p in svc["spec"]["ports"]:
        need(p.get("targetPort") in port_names, f"k8s: Service targetPort {p.get('targetPort')} is not a container port")
    for hpa in by_kind.get("HorizontalPodAutoscaler", []):
        need(hpa["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"], "k8s: the HPA targets another Deployment")
    for pdb in by_kind.get("PodDisruptionBudget", []):
        need(all(labels.get(k) == v for k, v in pdb["spec"]["selector"]["matchLabels"].items()), "k8s: the PDB selector does not match the pods")
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes", []) if "persistentVolumeClaim" in v}
    rendered_claims = {p["metadata"]["name"] for p in by_kind.get("PersistentVolumeClaim", [])}
    need(claims <= rendered_claims, f"k8s: PVC(s) {sorted(claims - rendered_claims)} used but not defined")


def check_network_policy(policies, labels, ports):
    """Only gateways and the ingress controller reach the verifier pods, on the verifier's port."""

    def everything(sel):
        """A selector given but empty: every pod (or namespace)."""
        return sel is not None and not sel.get("matchLabels") and not sel.get("matchExpressions")

    def selects(sel):
        """A selector that picks the verifier pods by their labels (an empty one, every pod, does not count)."""
        ml = sel.get("matchLabels") or {}
        return ml and not sel.get("matchExpressions") and all(labels.get(k) == v for k, v in ml.items())

    ports = {p for p in ports if p is not None}
    mine = [p for p in policies if selects(p["spec"].get("podSelector") or {})]
    if not need(mine, "k8s: no NetworkPolicy selects the verifier pods by their labels: every pod in the cluster could reach them"):
        return
    peers = []
    for pol in mine:
        name = f"k8s: NetworkPolicy {pol['metadata']['name']}"
        spec = pol["spec"]
        need("Ingress" in spec.get("policyTypes", []), f"{name}: policyTypes does not include Ingress")
        for rule in spec.get("ingress", []):
            sources = rule.get("from", [])
            need(sources, f"{name}: an ingress rule has no `from`: it admits every source")
            for peer in sources:
                ns, pods = peer.get("namespaceSelector"), peer.get("podSelector")
                need(not (everything(ns) and (pods is None or everything(pods))),
                     f"{name}: a peer admits every pod of every namespace (empty namespaceSelector)")
                need(not (everything(pods) and ns is None), f"{name}: a peer admits every pod of the namespace (empty podSelector)")
                need(peer.get("ipBlock", {}).get("cidr") not in ("0.0.0.0/0", "::/0"), f"{name}: a peer admits every address")
            peers += sources
            rule_ports = rule.get("ports", [])
            need(rule_ports, f"{name}: an ingress rule has no `ports`: it admits every port of the pods")
            for p in rule_ports:
                need(p.get("port") in ports and p.get("protocol", "TCP") == "TCP" and "endPort" not in p,
                     f"{name}: ingress port {p.get('port')}/{p.get('protocol', 'TCP')} is not the verifier's container port "
                     f"({', '.join(str(x) for x in sorted(ports, key=str))})")
    need(any((p.get("podSelector") or {}).get("matchLabels", {}).items() >= GATEWAY_LABELS.items() for p in peers),
         f"k8s: the verifier's NetworkPolicy has no podSelector peer for gateways "
         f"({', '.join(f'{k}: {v}' for k, v in GATEWAY_LABELS.items())})")
    need(any((p.get("namespaceSelector") or {}).get("matchLabels", {}).get("kubernetes.io/metadata.name") == INGRESS_NAMESPACE
             for p in peers),
         f"k8s: the verifier's NetworkPolicy does not admit the {INGRESS_NAMESPACE} namespace: the Ingress could not reach the pods")


def check_ingress(ingresses, svc):
    """The verifier is reached through header hashing: an ingress-nginx Ingress hashing the affinity header."""
    var = nginx_var(affinity_header())
    ports = {p.get("name") for p in svc["spec"]["ports"]} | {p["port"] for p in svc["spec"]["ports"]}

    def routes(ing):
        rules = ing["spec"].get("rules", [])
        backends = [p["backend"] for r in rules for p in r.get("http", {}).get("paths", [])]
        backends.append(ing["spec"].get("defaultBackend") or {})
        return [b["service"] for b in backends if b.get("service", {}).get("name") == svc["metadata"]["name"]]

    mine = [i for i in ingresses if routes(i)]
    if not need(mine, "k8s: no Ingress routes to the verifier Service; it must be reached through header hashing"):
        return
    for ing in mine:
        name = f"k8s: Ingress {ing['metadata']['name']}"
        for b in routes(ing):
            port = b.get("port", {})
            need(port.get("name") in ports or port.get("number") in ports, f"{name}: backend port {port} is not a port of the Service")
        ann = ing["metadata"].get("annotations", {})
        a = lambda k: ann.get("nginx.ingress.kubernetes.io/" + k)
        need(a("upstream-hash-by") == var, f"{name}: annotation nginx.ingress.kubernetes.io/upstream-hash-by is not {var!r}: "
                                           f"each conversation must keep reaching the replica that holds its prefix")
        need(ing["spec"].get("ingressClassName"), f"{name}: no ingressClassName")
        body = size_bytes(a("proxy-body-size") or "1m")
        need(body is not None and (body == 0 or body >= BODY_BYTES), f"{name}: proxy-body-size is below the verifier's 8 MiB")
        read = seconds(a("proxy-read-timeout") or "60")
        need(read is not None and read >= READ_SECS, f"{name}: proxy-read-timeout is under {READ_SECS} s; a long verify would be cut")
        nxt = (a("proxy-next-upstream") or "error timeout").split()
        need(FAILOVER <= set(nxt), f"{name}: proxy-next-upstream lacks {' '.join(sorted(FAILOVER - set(nxt)))}; {FAILOVER_WHY}")
        need(ing["spec"].get("tls"), f"{name}: no TLS; the API key and prompts would cross the network in clear")


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    {"docker": check_docker, "compose": check_compose, "nginx": check_nginx, "caddy": check_caddy, "k8s": check_k8s}[what](*args)
    for p in problems:
        print(p)
    sys.exit(1 if problems else 0)
