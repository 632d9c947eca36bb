#!/usr/bin/env bash
# Installs Claude Code (the npm package @anthropic-ai/claude-code) into the project's cache and prints the
# path of its `claude` executable. Idempotent: an installed copy of the wanted version is reused.
#   ASYNCRL_CLAUDE_CODE_VERSION  the version to install (default: the one tests/test_claude_code.py was written against)
#   ASYNCRL_CLAUDE_CODE_PREFIX   where (default: .cache/claude-code under the repository)
# Exit 3: npm is missing or the registry is unreachable (callers skip the Claude Code test then).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="${ASYNCRL_CLAUDE_CODE_VERSION:-2.1.197}"
PREFIX="${ASYNCRL_CLAUDE_CODE_PREFIX:-$ROOT/.cache/claude-code}"
CLAUDE="$PREFIX/node_modules/.bin/claude"

installed() {
    [ -x "$CLAUDE" ] && "$CLAUDE" --version 2>/dev/null | grep -q "^$VERSION "
}

if ! installed; then
    command -v npm >/dev/null || { echo "[claude_code] npm is not installed" >&2; exit 3; }
    mkdir -p "$PREFIX"
    # The package's postinstall links the platform's native binary (an optional dependency) into bin/.
    npm install --prefix "$PREFIX" --no-audit --no-fund --loglevel=error "@anthropic-ai/claude-code@$VERSION" >&2 \
        || { echo "[claude_code] npm install @anthropic-ai/claude-code@$VERSION failed" >&2; exit 3; }
    installed || { echo "[claude_code] installed, but $CLAUDE --version does not report $VERSION" >&2; exit 1; }
fi
echo "$CLAUDE"
