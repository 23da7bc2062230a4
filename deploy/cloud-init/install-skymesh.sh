#!/usr/bin/env bash
# Install SkyMesh into a venv, put its configuration and systemd units in place, and
# start the daemons of this host's roles. EC2 user data runs it at first boot (Terraform's
# terraform/modules/region renders the preamble); an operator can run it from a checkout:
#
#   sudo SKYMESH_ROLES=lb,replica deploy/cloud-init/install-skymesh.sh
#
# Settings (environment):
#   SKYMESH_ROLES      comma-separated: lb, replica, controller              (lb)
#   SKYMESH_PREFIX     where the venv goes                                   (/opt/skymesh)
#   SKYMESH_ROOT       filesystem root for /etc (a temp dir in tests)        (empty: /)
#   SKYMESH_STAGE      dir holding systemd/*.service and config/* to install (this checkout's deploy/)
#   SKYMESH_PYTHON     interpreter to build the venv with                    (python3)
#   SKYMESH_WHEEL_URL  the operator's wheels, space-separated: s3://BUCKET/KEY.whl,
#                      https://...whl or local paths; fetched, checked, installed. The data
#                      plane's (skymesh-*.whl), and for the replica and controller roles
#                      skymesh_replica-*.whl and skymesh_controller-*.whl (installed with
#                      its `planning` extra)
#   SKYMESH_WHEEL_SHA256  hex SHA-256 of each wheel, space-separated, in order: required
#                      for every s3:// or https:// wheel (a local path may go without)
#   SKYMESH_PIP_SPEC   instead of wheels: local paths only, words split (e.g. "-e /src/skymesh
#                      /src/skymesh/replica"). A package name is refused: nothing is ever
#                      installed from an index by name
# Either SKYMESH_WHEEL_URL or SKYMESH_PIP_SPEC must be given: there is no default. The
# dependencies are pinned by the lock that ships inside the data plane's wheel
# (skymesh/constraints.txt), or a checkout's requirements/lock.txt, as pip constraints.
#   SKYMESH_PIP_ARGS   extra pip flags, words split                          (none)
#   SKYMESH_USER       the service account                                   (skymesh)
#   SKYMESH_EIP_ALLOCATION_ID   on EC2: associate this Elastic IP with the instance
#   SKYMESH_CERTS_SSM_PREFIX    on EC2: fetch ca.crt, ID.crt, ID.key of the mesh from SSM
#   SKYMESH_MESH_ID             the balancer id whose certificate to fetch
#   SKYMESH_API_KEYS_SSM_PARAM  on EC2: fetch the balancer's client API keys (one per
#                               line, SecureString) from this SSM parameter
#   SKYMESH_TLS_SSM_PREFIX      on EC2: fetch edge.crt and edge.key (HTTPS for clients)
#                               from under this SSM path into /etc/skymesh/tls
# systemctl runs only when installing into the real root of a host booted with systemd.
set -euo pipefail

log() { printf 'install-skymesh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 2; }

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROLES="${SKYMESH_ROLES:-lb}"
PREFIX="${SKYMESH_PREFIX:-/opt/skymesh}"
ROOT="${SKYMESH_ROOT:-}"
STAGE="${SKYMESH_STAGE:-$(dirname "$here")}"
PYTHON="${SKYMESH_PYTHON:-python3}"
SVC_USER="${SKYMESH_USER:-skymesh}"
read -r -a PIP_SPEC <<< "${SKYMESH_PIP_SPEC:-}"
read -r -a PIP_ARGS <<< "${SKYMESH_PIP_ARGS:-}"
ETC_DIR="$ROOT/etc/skymesh"
UNIT_DIR="$ROOT/etc/systemd/system"

declare -A CONFIG_OF=([lb]=lb.yaml [replica]=replica.env [controller]=controller.yaml)
# The wheel's extras each role's daemon imports (pyproject.toml): the core alone runs
# The distribution whose wheel brings each role's command (docs/deploy.md).
declare -A DIST_OF=([lb]=skymesh [replica]=skymesh-replica [controller]=skymesh-controller)
IFS=',' read -r -a roles <<< "$ROLES"
for role in "${roles[@]}"; do
  [[ -n "${CONFIG_OF[$role]:-}" ]] || die "unknown role '$role' (lb, replica, controller)"
  [[ -f "$STAGE/systemd/skymesh-$role.service" ]] || die "missing $STAGE/systemd/skymesh-$role.service"
  [[ -f "$STAGE/config/${CONFIG_OF[$role]}" ]] || die "missing $STAGE/config/${CONFIG_OF[$role]}"
done

as_root() { [[ "$(id -u)" == 0 ]]; }

# 1. The service account (system user, no login, no home), on the real root only.
if as_root && [[ -z "$ROOT" ]] && ! id "$SVC_USER" >/dev/null 2>&1; then
  useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin "$SVC_USER"
  log "created user $SVC_USER"
fi

# 2. The operator's wheel, when given: fetched with the system interpreter (boto3 from
# python3-boto3 for s3://), so nothing but its dependencies comes from a package index.
fetch_wheel() {  # URL SHA256 -> the checked local file, on stdout
  local url="$1" sum="$2" dir wheel
  dir="$(mktemp -d)"
  wheel="$dir/${url##*/}"
  [[ "$wheel" == *.whl ]] || die "SKYMESH_WHEEL_URL must name .whl files: $url"
  case "$url" in  # what is fetched is checked: a changed file is never installed
    s3://* | https://* | http://*) [[ -n "$sum" ]] ||
      die "$url: a fetched wheel needs its SHA-256 (SKYMESH_WHEEL_SHA256)" ;;
  esac
  case "$url" in
    s3://*)
      "$PYTHON" - "$url" "$wheel" <<'PY' || die "cannot fetch $url"
import sys
import boto3
bucket, _, key = sys.argv[1].removeprefix("s3://").partition("/")
boto3.client("s3").download_file(bucket, key, sys.argv[2])
PY
      ;;
    https://* | http://*)
      "$PYTHON" - "$url" "$wheel" <<'PY' || die "cannot fetch $url"
import shutil, sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=60) as r, open(sys.argv[2], "wb") as f:
    shutil.copyfileobj(r, f)
PY
      ;;
    *://*) die "SKYMESH_WHEEL_URL: only s3://, https:// or a local path, not $url" ;;
    *) cp -- "$url" "$wheel" || die "cannot read $url" ;;
  esac
  if [[ -n "$sum" ]]; then
    echo "$sum  $wheel" | sha256sum --check --quiet - >/dev/null 2>&1 ||
      die "$url does not have SHA-256 $sum; not installing it"
  fi
  printf '%s\n' "$wheel"
}

constraints_of() {  # WHEEL_OR_DIR -> a file of pip constraints (the release's lock), or nothing
  local src="$1" out
  out="$(mktemp)"
  if [[ -d "$src" && -f "$src/requirements/lock.txt" ]]; then
    cp -- "$src/requirements/lock.txt" "$out"
  elif [[ -f "$src" ]] && "$PYTHON" - "$src" "$out" <<'PY' 2>/dev/null; then
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as whl, open(sys.argv[2], "wb") as f:
    f.write(whl.read("skymesh/constraints.txt"))
PY
    :
  else
    rm -f "$out"
    return 0
  fi
  printf '%s\n' "$out"
}

CONSTRAINTS=""
if [[ -n "${SKYMESH_WHEEL_URL:-}" ]]; then
  read -r -a urls <<< "$SKYMESH_WHEEL_URL"
  read -r -a sums <<< "${SKYMESH_WHEEL_SHA256:-}"
  (( ${#sums[@]} == 0 || ${#sums[@]} == ${#urls[@]} )) ||
    die "SKYMESH_WHEEL_SHA256 has ${#sums[@]} hashes for ${#urls[@]} wheels"
  PIP_SPEC=()
  for i in "${!urls[@]}"; do
    wheel="$(fetch_wheel "${urls[$i]}" "${sums[$i]:-}")"
    [[ "${wheel##*/}" == skymesh-[0-9]* ]] && CONSTRAINTS="$(constraints_of "$wheel")"
    # The controller's planner (forecasts, the ILP) is its `planning` extra.
    [[ "${wheel##*/}" == skymesh_controller-* ]] && wheel="$wheel[planning]"
    PIP_SPEC+=("$wheel")
    log "fetched ${urls[$i]}; installing ${wheel##*/}"
  done
elif (( ${#PIP_SPEC[@]} )); then
  for word in "${PIP_SPEC[@]}"; do
    case "$word" in
      -*) ;;  # a pip flag (-e, --no-deps ...)
      /* | ./* | ../*)
        [[ -e "${word%%\[*}" ]] || die "SKYMESH_PIP_SPEC: no such path: $word"
        [[ -z "$CONSTRAINTS" ]] && CONSTRAINTS="$(constraints_of "${word%%\[*}")" ;;
      *) die "SKYMESH_PIP_SPEC: '$word' is not a local path; name the operator's wheel \
(SKYMESH_WHEEL_URL with SKYMESH_WHEEL_SHA256) or a path, never a package name" ;;
    esac
  done
else
  die "name what to install: SKYMESH_WHEEL_URL (with SKYMESH_WHEEL_SHA256) or \
SKYMESH_PIP_SPEC (local paths); nothing is installed from a package index by name"
fi
if [[ -n "$CONSTRAINTS" ]]; then
  PIP_ARGS+=(-c "$CONSTRAINTS")
  log "dependencies pinned by the release's lock ($(grep -c '==' "$CONSTRAINTS") pins)"
else
  log "warning: no lock found with what was named (skymesh/constraints.txt in the wheel, \
or requirements/lock.txt in a checkout): dependencies resolve afresh"
fi

# 3. The venv. Re-running upgrades in place.
if [[ ! -x "$PREFIX/venv/bin/python" ]]; then
  mkdir -p "$PREFIX"
  "$PYTHON" -m venv "$PREFIX/venv"
fi
PIP_DISABLE_PIP_VERSION_CHECK=1 "$PREFIX/venv/bin/python" -m pip install -q \
  "${PIP_ARGS[@]}" "${PIP_SPEC[@]}"
for role in "${roles[@]}"; do
  [[ -x "$PREFIX/venv/bin/skymesh-$role" ]] ||
    die "pip did not install skymesh-$role (role $role needs the ${DIST_OF[$role]} wheel)"
done
log "installed $("$PREFIX/venv/bin/python" -m pip show skymesh 2>/dev/null | sed -n 's/^Version: /skymesh /p')"

# 4. Configuration: readable by the service account, by nobody else.
mkdir -p "$ETC_DIR"
for role in "${roles[@]}"; do
  install -m 0640 "$STAGE/config/${CONFIG_OF[$role]}" "$ETC_DIR/${CONFIG_OF[$role]}"
done
if [[ " ${roles[*]} " == *" lb "* ]]; then
  # Client API keys: staged ones, else the ones already there, else an empty file the
  # operator fills (skymesh-lb refuses a public address without keys and says so).
  if [[ -f "$STAGE/config/api-keys" ]]; then
    install -m 0640 "$STAGE/config/api-keys" "$ETC_DIR/api-keys"
  elif [[ ! -f "$ETC_DIR/api-keys" ]]; then
    install -m 0640 /dev/null "$ETC_DIR/api-keys"
    [[ -n "${SKYMESH_API_KEYS_SSM_PARAM:-}" ]] ||
      log "add client API keys to $ETC_DIR/api-keys (one per line) before skymesh-lb can serve"
  fi
fi
if [[ -d "$STAGE/pki" ]]; then
  mkdir -p "$ETC_DIR/pki"
  install -m 0640 "$STAGE"/pki/* "$ETC_DIR/pki/"
fi

# 5. On EC2: the balancer's stable address and its mesh certificates.
if [[ -n "${SKYMESH_EIP_ALLOCATION_ID:-}" ]]; then
  "$PREFIX/venv/bin/python" - "$SKYMESH_EIP_ALLOCATION_ID" <<'PY'
import sys, urllib.request
import boto3
def imds(path, token=None):
    req = urllib.request.Request("http://169.254.169.254/latest/" + path,
                                 method="PUT" if token is None else "GET")
    if token is None:
        req.add_header("X-aws-ec2-metadata-token-ttl-seconds", "300")
    else:
        req.add_header("X-aws-ec2-metadata-token", token)
    return urllib.request.urlopen(req, timeout=5).read().decode()
token = imds("api/token")
instance = imds("meta-data/instance-id", token)
region = imds("meta-data/placement/region", token)
boto3.client("ec2", region_name=region).associate_address(
    AllocationId=sys.argv[1], InstanceId=instance, AllowReassociation=True)
print(f"install-skymesh: associated {sys.argv[1]} with {instance}", file=sys.stderr)
PY
fi
if [[ -n "${SKYMESH_CERTS_SSM_PREFIX:-}${SKYMESH_API_KEYS_SSM_PARAM:-}${SKYMESH_TLS_SSM_PREFIX:-}" ]]; then
  if [[ -n "${SKYMESH_CERTS_SSM_PREFIX:-}" ]]; then
    [[ -n "${SKYMESH_MESH_ID:-}" ]] || die "SKYMESH_CERTS_SSM_PREFIX needs SKYMESH_MESH_ID"
    mkdir -p "$ETC_DIR/pki"
  fi
  [[ -z "${SKYMESH_TLS_SSM_PREFIX:-}" ]] || mkdir -p "$ETC_DIR/tls"
  # Parameter name -> file, all SecureStrings: the mesh certificates, the client keys,
  # the clients' TLS pair.
  "$PREFIX/venv/bin/python" - "${SKYMESH_CERTS_SSM_PREFIX:-}" "${SKYMESH_MESH_ID:-}" \
      "${SKYMESH_API_KEYS_SSM_PARAM:-}" "${SKYMESH_TLS_SSM_PREFIX:-}" "$ETC_DIR" <<'PY'
import os, sys, urllib.request
import boto3
prefix, mesh_id, keys_param, tls_prefix, etc = sys.argv[1].rstrip("/"), *sys.argv[2:6]
wanted = {}
if prefix:
    for name in ("ca.crt", f"{mesh_id}.crt", f"{mesh_id}.key"):
        wanted[f"{prefix}/{name}"] = os.path.join(etc, "pki", name)
if keys_param:
    wanted[keys_param] = os.path.join(etc, "api-keys")
if tls_prefix:
    for name in ("edge.crt", "edge.key"):
        wanted[f"{tls_prefix.rstrip('/')}/{name}"] = os.path.join(etc, "tls", name)
tok = urllib.request.Request("http://169.254.169.254/latest/api/token", method="PUT",
                             headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"})
token = urllib.request.urlopen(tok, timeout=5).read().decode()
reg = urllib.request.Request("http://169.254.169.254/latest/meta-data/placement/region",
                             headers={"X-aws-ec2-metadata-token": token})
ssm = boto3.client("ssm", region_name=urllib.request.urlopen(reg, timeout=5).read().decode())
for param, path in wanted.items():
    value = ssm.get_parameter(Name=param, WithDecryption=True)["Parameter"]["Value"]
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640), "w") as f:
        f.write(value)
    print(f"install-skymesh: fetched {param} into {path}", file=sys.stderr)
PY
fi
if as_root && [[ -z "$ROOT" ]]; then
  chown -R "root:$SVC_USER" "$ETC_DIR"
fi

# 6. Units, pointed at this prefix and this /etc.
mkdir -p "$UNIT_DIR"
for role in "${roles[@]}"; do
  sed -e "s#/opt/skymesh/#$PREFIX/#g" -e "s#/etc/skymesh/#$ETC_DIR/#g" \
    "$STAGE/systemd/skymesh-$role.service" > "$UNIT_DIR/skymesh-$role.service"
  chmod 0644 "$UNIT_DIR/skymesh-$role.service"
done

# 7. Start them, when there is a systemd to start them with.
if [[ -z "$ROOT" && -d /run/systemd/system ]]; then
  systemctl daemon-reload
  for role in "${roles[@]}"; do
    systemctl enable --now "skymesh-$role.service"
    log "started skymesh-$role"
  done
else
  log "not running under systemd at / : units written to $UNIT_DIR, not started"
fi
