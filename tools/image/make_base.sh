#!/usr/bin/env bash
# The base image deploy/docker/Dockerfile builds FROM, made locally: Docker Hub is not
# reachable from every build host, Debian's mirror is. A Debian bookworm root filesystem
# (debootstrap, minbase) with python3 (3.11, what the project targets), venv and pip,
# brought up to bookworm-security, imported into buildah (from scratch + commit) or docker
# (docker import) under the tag the Dockerfile's BASE_IMAGE default names.
#
# The build host's CA bundle goes in as a separate file, /etc/ssl/certs/build-host-ca.crt:
# pip in the builder stage trusts what this host trusts (an egress proxy's CA, say), and
# the runtime stage deletes it, so the shipped image trusts only Debian's CAs.
#
# Usage: tools/image/make_base.sh [--force]
#   SKYMESH_IMAGE_ENGINE  buildah (default) or docker
#   SKYMESH_BASE_IMAGE    tag to create (default localhost/skymesh-base:bookworm)
#   DEBIAN_MIRROR         (default http://deb.debian.org/debian)
#   HOST_CA_BUNDLE        (default /etc/ssl/certs/ca-certificates.crt)
set -euo pipefail

ENGINE=${SKYMESH_IMAGE_ENGINE:-buildah}
TAG=${SKYMESH_BASE_IMAGE:-localhost/skymesh-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CA=${HOST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
# vfs: works in any container or VM (no overlay mounts needed); chroot: no user namespaces.
BUILDAH=(buildah --storage-driver vfs)

exists() {
  case $ENGINE in
    buildah) "${BUILDAH[@]}" inspect --type image "$TAG" >/dev/null 2>&1 ;;
    docker) docker image inspect "$TAG" >/dev/null 2>&1 ;;
    *) echo "SKYMESH_IMAGE_ENGINE must be buildah or docker, not $ENGINE" >&2; exit 2 ;;
  esac
}

if [[ ${1:-} != --force ]] && exists; then
  echo "base image $TAG exists ($ENGINE); --force rebuilds it"
  exit 0
fi
for tool in debootstrap "$ENGINE"; do
  command -v "$tool" >/dev/null || { echo "missing: $tool (apt-get install $tool)" >&2; exit 2; }
done
[[ $(id -u) == 0 ]] || { echo "debootstrap needs root" >&2; exit 2; }
[[ -s $CA ]] || { echo "no CA bundle at $CA" >&2; exit 2; }

work=$(mktemp -d /var/tmp/skymesh-base.XXXXXX)
ctr=""
cleanup() {
  [[ -n $ctr ]] && "${BUILDAH[@]}" rm "$ctr" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
root=$work/rootfs

debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
  bookworm "$root" "$MIRROR"

cat >"$root/etc/apt/sources.list" <<SOURCES
deb ${MIRROR} bookworm main
deb ${MIRROR} bookworm-updates main
deb ${MIRROR%/debian}/debian-security bookworm-security main
SOURCES
# Mirrors that serve snapshots carry expired Release files; signatures are still checked.
chroot "$root" apt-get -o Acquire::Check-Valid-Until=false update -qq
DEBIAN_FRONTEND=noninteractive chroot "$root" apt-get -o Acquire::Check-Valid-Until=false \
  -y -qq upgrade
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* "$root"/usr/share/man/* \
  "$root"/var/log/*.log "$root"/var/cache/debconf/*-old
cp "$CA" "$root/etc/ssl/certs/build-host-ca.crt"

tar -C "$root" --numeric-owner -cf "$work/rootfs.tar" .
case $ENGINE in
  buildah)
    ctr=$("${BUILDAH[@]}" from scratch)
    "${BUILDAH[@]}" add "$ctr" "$work/rootfs.tar" /
    "${BUILDAH[@]}" config --env LANG=C.UTF-8 --cmd /bin/bash "$ctr"
    "${BUILDAH[@]}" commit --rm -q "$ctr" "$TAG"
    ctr=""
    ;;
  docker)
    docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' \
      "$work/rootfs.tar" "$TAG"
    ;;
esac
echo "base image $TAG built with $ENGINE"
