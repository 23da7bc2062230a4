#!/bin/sh
# The image's entrypoint: runs the daemon named by the first argument, as PID 1 (exec), so
# it gets the container's signals and the health check finds its command line.
#
#   skymesh-lb ARGS | skymesh-controller ARGS | skymesh-replica ARGS | skymesh ARGS
#
# Each role's image holds its own daemon (the balancer's: skymesh-lb; the controller's and
# the replica's: theirs, and skymesh-lb with the data plane they build on); with no
# arguments it prints the help of its role's daemon.
#
# A container is reached through its own interfaces, not its loopback, so a daemon given
# neither --host nor --config (whose listen.host then decides) binds 0.0.0.0 here; the
# daemons' own default, 127.0.0.1, suits a host install.
set -eu

usage() {
  echo "usage: IMAGE skymesh-lb|skymesh-controller|skymesh-replica|skymesh [ARGS...]" >&2
}

# No command: the help of this image's daemon (SKYMESH_ROLE, set at build time).
if [ $# -eq 0 ]; then
  case ${SKYMESH_ROLE:-} in
    balancer) set -- skymesh-lb --help ;;
    controller) set -- skymesh-controller --help ;;
    replica) set -- skymesh-replica --help ;;
    *) usage; exit 64 ;;
  esac
fi
case $1 in
  skymesh-lb | skymesh-controller | skymesh-replica)
    # Each role's image carries its own daemon (and the data plane's): say so, rather than
    # the shell's bare "not found", when another role's daemon is asked for.
    command -v "$1" >/dev/null 2>&1 || {
      echo "$1 is not in this image (the ${SKYMESH_ROLE:-?} image; docs/image.md:" \
        "one image per role, skymesh-ROLE)" >&2
      exit 64
    }
    for arg in "$@"; do
      case $arg in
        --host | --host=* | --config | --config=* | -h | --help | --version) exec "$@" ;;
      esac
    done
    exec "$@" --host 0.0.0.0
    ;;
  skymesh) exec "$@" ;;
  *) usage; echo "not a SkyMesh command: $1" >&2; exit 64 ;;
esac
