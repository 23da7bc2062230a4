#!/bin/sh
# The image's entrypoint: runs the daemon named by the first argument, as PID 1 (exec), so
# it gets the container's signals and the health check finds its command line.
#
#   skymesh-lb ARGS | skymesh-controller ARGS | skymesh-replica ARGS | skymesh ARGS
#
# A container is reached through its own interfaces, not its loopback, so a daemon given
# neither --host nor --config (whose listen.host then decides) binds 0.0.0.0 here; the
# daemons' own default, 127.0.0.1, suits a host install.
set -eu

usage() {
  echo "usage: IMAGE skymesh-lb|skymesh-controller|skymesh-replica|skymesh [ARGS...]" >&2
}

[ $# -gt 0 ] || { usage; exit 64; }
case $1 in
  skymesh-lb | skymesh-controller | skymesh-replica)
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
