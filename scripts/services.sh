#!/usr/bin/env bash
# Make sure PostgreSQL and Redis answer on 127.0.0.1 (the database and channel-layer tests use them).
set -u
if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
  echo "starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
fi
if ! (redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG); then
  command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
  echo "starting Redis"
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save '' --appendonly no || true
fi
for _ in $(seq 30); do
  pg_isready -q -h 127.0.0.1 -p 5432 && redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG && exit 0
  sleep 1
done
echo "PostgreSQL or Redis did not come up" >&2
exit 1
