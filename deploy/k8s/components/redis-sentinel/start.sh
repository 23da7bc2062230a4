#!/bin/sh
# Starts one pod's redis-server (ROLE=redis) or sentinel (ROLE=sentinel) of the
# skymesh-redis StatefulSet. The primary is whatever the sentinels already name (a pod
# restarting after a failover joins the new primary); on the very first start, when no
# sentinel answers, pod 0 is the primary. Pods are named by the headless Service.
set -eu
SVC=skymesh-redis
RUN_DIR="${RUN_DIR:-/run/redis}"  # the pod's emptyDir
ME="$(hostname).${SVC}"
PRIMARY=""
for i in 0 1 2; do
  [ "${SVC}-${i}.${SVC}" = "${ME}" ] && continue
  PRIMARY="$(redis-cli -h "${SVC}-${i}.${SVC}" -p 26379 --raw \
      SENTINEL get-master-addr-by-name skymesh 2>/dev/null | head -n 1 || true)"
  [ -n "${PRIMARY}" ] && break
done
[ -n "${PRIMARY}" ] || PRIMARY="${SVC}-0.${SVC}"
if [ "${ROLE}" = "sentinel" ]; then
  # Sentinel rewrites its config file: it lives on the pod's emptyDir.
  cat > "${RUN_DIR}/sentinel.conf" <<CONF
port 26379
dir ${RUN_DIR}
sentinel resolve-hostnames yes
sentinel announce-hostnames yes
sentinel announce-ip ${ME}
sentinel monitor skymesh ${PRIMARY} 6379 2
sentinel auth-pass skymesh ${REDIS_PASSWORD}
sentinel down-after-milliseconds skymesh 5000
sentinel failover-timeout skymesh 60000
sentinel parallel-syncs skymesh 1
CONF
  exec redis-server "${RUN_DIR}/sentinel.conf" --sentinel
fi
# The durability of docs/operations-control-ha.md: every write on disk before Redis
# answers, and no write the primary cannot hand to a replica.
set -- --dir /data --appendonly yes --appendfsync always --save "" \
  --requirepass "${REDIS_PASSWORD}" --masterauth "${REDIS_PASSWORD}" \
  --replica-announce-ip "${ME}" --min-replicas-to-write 1 --min-replicas-max-lag 10
if [ "${PRIMARY}" != "${ME}" ]; then
  set -- "$@" --replicaof "${PRIMARY}" 6379
fi
exec redis-server "$@"
