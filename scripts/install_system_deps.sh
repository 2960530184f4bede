#!/usr/bin/env bash
# Install the Debian packages that tests and evaluation use, only if missing:
#   prometheus  promtool validates docker/'s Prometheus config; a real scraper for the metrics tests
#   bible-kjv   `bible -f "Gen1:1-Rev22:21"` prints the default long evaluation text (scripture)
#   debian-reference-en, jargon-text, libpython3-stdlib
#               the other evaluation corpora (bench/eval/corpora.py): technical documentation, modern
#               prose, source code (the standard library's modules), so quality is measured on more than
#               one kind of text
#   nginx       the gRPC router with session affinity that tests/deploy/test_nginx_affinity.py runs on
#               loopback in front of real server processes (its service is not started or enabled)
#   util-linux  setpriv, under which the tests start their servers (tests/_live_server.py: SIGTERM when the test
#               process dies; Debian marks it essential, so this only states the dependency)
# Non-interactive as root (CI). Where they are missing and cannot be installed (not root, no apt-get) it
# says what to install and exits 1, so `make test` fails rather than let the tests that need them skip
# unnoticed. RETOPK_SKIP_SYSTEM_DEPS=1 (`RETOPK_SKIP_SYSTEM_DEPS=1 make test`) is the explicit opt-out:
# exit 0, and those tests skip with their own reason.
set -euo pipefail

PACKAGES=(prometheus bible-kjv nginx debian-reference-en jargon-text libpython3-stdlib util-linux)

missing=()
for pkg in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done

if ((${#missing[@]} == 0)); then
    echo "install_system_deps: already installed: ${PACKAGES[*]}"
    exit 0
fi
cannot() {
    echo "install_system_deps: $1; missing: ${missing[*]}. $2" >&2
    if [[ "${RETOPK_SKIP_SYSTEM_DEPS:-}" == "1" ]]; then
        echo "install_system_deps: RETOPK_SKIP_SYSTEM_DEPS=1: going on without them (the tests that need them skip)" >&2
        exit 0
    fi
    echo "install_system_deps: failing; install them, or set RETOPK_SKIP_SYSTEM_DEPS=1 to run without them" >&2
    exit 1
}
if ! command -v apt-get >/dev/null 2>&1; then
    cannot "no apt-get here" "Install them by hand."
fi
if [[ "$(id -u)" -ne 0 ]]; then
    cannot "not root" "Run: sudo apt-get install ${missing[*]}"
fi

echo "install_system_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# Keep maintainer scripts from starting services (nginx would take port 80): policy-rc.d says no
# for the length of the install, unless the system already has a policy of its own.
policy=/usr/sbin/policy-rc.d
if [[ ! -e "$policy" ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy"
    trap 'rm -f "$policy"' EXIT
fi
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
