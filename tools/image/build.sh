#!/usr/bin/env bash
# Build deploy/docker/Dockerfile for $ROLE as TAG (default skymesh-ROLE:VERSION):
# with docker when a daemon answers, else with buildah (vfs storage, chroot isolation,
# the host's network: it runs in containers and VMs without a daemon or user
# namespaces). The local base image is made first if missing (tools/image/make_base.sh).
# SKYMESH_IMAGE_ENGINE=buildah|docker forces an engine. Run from anywhere.
set -euo pipefail
cd "$(dirname "$0")/../.."

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)
# ROLE: balancer (default), controller or replica; one image each (docs/image.md).
ROLE=${ROLE:-balancer}
TAG=${1:-skymesh-$ROLE:$version}
if [[ -z ${SKYMESH_IMAGE_ENGINE:-} ]]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    SKYMESH_IMAGE_ENGINE=docker
  else
    SKYMESH_IMAGE_ENGINE=buildah
  fi
fi
export SKYMESH_IMAGE_ENGINE
tools/image/make_base.sh

case $SKYMESH_IMAGE_ENGINE in
  docker) docker build --build-arg ROLE="$ROLE" -f deploy/docker/Dockerfile -t "$TAG" . ;;
  buildah)
    # --layers: reuse cached layers (buildah's default rebuilds every step); docker
    # format: OCI's image config has no HEALTHCHECK.
    buildah --storage-driver vfs bud --layers --format docker --isolation chroot \
      --network host --build-arg ROLE="$ROLE" -f deploy/docker/Dockerfile -t "$TAG" .
    ;;
  *) echo "SKYMESH_IMAGE_ENGINE must be buildah or docker" >&2; exit 2 ;;
esac
echo "built $TAG with $SKYMESH_IMAGE_ENGINE"
