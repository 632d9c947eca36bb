#!/usr/bin/env bash
# Start the services the tests talk to, where none is answering already. Needs root (or sudo)
# only when a package has to be installed.

# Redis on 127.0.0.1:${ASYNCRL_REDIS_PORT:-6379}; exported as ASYNCRL_REDIS_URL for the tests.
ensure_redis() {
    local port="${ASYNCRL_REDIS_PORT:-6379}"
    export ASYNCRL_REDIS_URL="redis://127.0.0.1:$port/0"
    if command -v redis-cli >/dev/null 2>&1 && redis-cli -p "$port" ping 2>/dev/null | grep -q PONG; then
        return 0
    fi
    if ! command -v redis-server >/dev/null 2>&1; then
        echo "[services] installing redis-server"
        _apt_install redis-server
    fi
    echo "[services] starting redis-server on 127.0.0.1:$port"
    redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --save "" --appendonly no \
        --dir /tmp --logfile /tmp/asyncrl-redis.log
    for _ in $(seq 1 50); do
        redis-cli -p "$port" ping 2>/dev/null | grep -q PONG && return 0
        sleep 0.1
    done
    echo "[services] redis did not start; see /tmp/asyncrl-redis.log" >&2
    return 1
}

_apt_install() {
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}
