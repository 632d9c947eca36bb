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

# bubblewrap for the `process` sandbox backend.
ensure_bubblewrap() {
    command -v bwrap >/dev/null 2>&1 && return 0
    echo "[services] installing bubblewrap"
    _apt_install bubblewrap
}

# A headless Chromium (Debian's `chromium`) for the tests that open the replay report in a browser
# (tests/browser.py). Installs it only as root; returns 1, saying why, where it cannot.
ensure_chromium() {
    command -v chromium >/dev/null 2>&1 && return 0
    if [ "$(id -u)" -ne 0 ]; then
        echo "[services] no chromium, and installing it needs root" >&2
        return 1
    fi
    echo "[services] installing chromium"
    _apt_install chromium && command -v chromium >/dev/null 2>&1
}

# A Docker engine for the `docker` sandbox backend, and the sandbox image; DOCKER_HOST is exported
# for the tests. An engine that already answers (at $DOCKER_HOST or the default socket) is used as
# it is. Otherwise Debian's docker.io is installed and dockerd started on a private socket with a data
# root of its own, leaving the host's network alone (no iptables rules, no bridge: the sandboxes run
# without a network). Needs root to start an engine; returns 1, saying why, where it cannot.
ensure_docker() {
    if ! _docker_answers; then
        local dir="${ASYNCRL_DOCKER_DIR:-/run/asyncrl-docker}"
        export DOCKER_HOST="unix://$dir/docker.sock"
        if ! _docker_answers; then
            if [ "$(id -u)" -ne 0 ]; then
                echo "[services] no Docker engine answers and starting one needs root" >&2
                unset DOCKER_HOST
                return 1
            fi
            if ! command -v dockerd >/dev/null 2>&1; then
                echo "[services] installing docker.io"
                _apt_install docker.io
            fi
            echo "[services] starting dockerd on $DOCKER_HOST"
            mkdir -p "$dir"
            nohup setsid dockerd --host "$DOCKER_HOST" --data-root /var/lib/asyncrl-docker \
                --exec-root "$dir/exec" --pidfile "$dir/dockerd.pid" --iptables=false --bridge=none \
                >/tmp/asyncrl-dockerd.log 2>&1 &
            local up=""
            for _ in $(seq 1 300); do
                _docker_answers && { up=1; break; }
                sleep 0.2
            done
            if [ -z "$up" ]; then
                echo "[services] dockerd did not answer within 60 s; see /tmp/asyncrl-dockerd.log" >&2
                return 1
            fi
        fi
    fi
    bash "$(dirname "${BASH_SOURCE[0]}")/build_sandbox_image.sh"
}

_docker_answers() {
    command -v docker >/dev/null 2>&1 && timeout 10 docker version --format '{{.Server.Version}}' >/dev/null 2>&1
}

_apt_install() {
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}
