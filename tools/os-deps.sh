#!/usr/bin/env bash
# The OS packages a make target runs, installed when they are missing, and nothing else.
#
#   tools/os-deps.sh demo          what `make demo` (and `make venv`, `make bench`) runs
#   tools/os-deps.sh test          what `make test` runs: the demo's, plus the tests' own tools
#   tools/os-deps.sh demo --plan   print what would be installed and why; install nothing
#
# Before installing it prints each package with the reason it is needed. apt-get gets
# --no-install-recommends (recommends pulled 180 packages and system daemons into a test machine),
# and no service is started or left enabled: a package's own daemon (mosquitto on :1883, nginx on
# :80, prometheus on :9090) is not what the demo or the tests use; they start their own on free
# ports. Debian's way to keep a package from starting its service is /usr/sbin/policy-rc.d
# answering 101 (invoke-rc.d and deb-systemd-invoke ask it); it does not stop deb-systemd-helper
# from enabling the unit for the next boot, so the units of every package this run added are
# disabled afterwards.
set -euo pipefail

target="${1:-}"
mode="${2:-install}"
case "$target" in demo | test) ;; *)
  echo "usage: $0 demo|test [--plan]" >&2
  exit 2
  ;;
esac
case "$mode" in install | --plan) ;; *)
  echo "usage: $0 demo|test [--plan]" >&2
  exit 2
  ;;
esac

packages=() # apt names
reasons=()
want() { # want "reason" apt-package...
  local reason="$1"
  shift
  packages+=("$@")
  reasons+=("$* : $reason")
}

# --- make demo -----------------------------------------------------------------------------------
"${PYTHON:-python3}" -c 'import ensurepip, venv' >/dev/null 2>&1 \
  || want "python3 -m venv makes .venv (Debian and Ubuntu ship venv's ensurepip separately)" python3-venv
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] \
  || want "the MQTT broker: the demo starts its own on a free port (its system service stays off)" mosquitto

# --- make test: the tests' own tools on top ------------------------------------------------------
if [ "$target" = test ]; then
  command -v gst-launch-1.0 >/dev/null 2>&1 \
    || want "gst-launch-1.0: the GStreamer camera source is tested as a real subprocess" \
      gstreamer1.0-tools gstreamer1.0-plugins-base gstreamer1.0-plugins-good
  /usr/bin/python3 -c 'import gi; gi.require_version("GstRtspServer", "1.0")' >/dev/null 2>&1 \
    || want "the RTSP camera tests run gst-rtsp-server under the system python3 (tests/camera/rtsp_serve.py)" \
      python3-gi gir1.2-gst-rtsp-server-1.0
  gst-inspect-1.0 x264enc >/dev/null 2>&1 \
    || want "x264enc: the test RTSP cameras encode H.264 live" gstreamer1.0-plugins-ugly
  gst-inspect-1.0 x265enc >/dev/null 2>&1 \
    || want "x265enc: the test RTSP cameras encode H.265 live" gstreamer1.0-plugins-bad
  command -v ffmpeg >/dev/null 2>&1 \
    || want "bench/cameras.py compares the agent's decode CPU with \`ffmpeg -i URL -f null -\`" ffmpeg
  command -v prometheus >/dev/null 2>&1 \
    || want "the metrics tests scrape /metrics and run the dashboard's queries on a real Prometheus" prometheus
  command -v prometheus-alertmanager >/dev/null 2>&1 \
    || want "the alert rules are delivered end to end through a real Alertmanager to a webhook" prometheus-alertmanager
  [ -x /usr/bin/chromium ] \
    || want "the fleet console's browser tests drive it through Playwright (never a browser download)" chromium
  command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] \
    || want "the console's documented TLS reverse proxy is run for real (tests/fleet/console/test_proxy.py)" nginx
  compgen -G '/usr/lib/postgresql/*/bin/pg_ctl' >/dev/null \
    || want "the controller's store on PostgreSQL: tests start their own server (initdb, pg_ctl) on a free port" postgresql
fi

if [ ${#packages[@]} -eq 0 ]; then
  echo "os-deps ($target): every OS package it needs is installed"
  exit 0
fi
echo "os-deps ($target): installing ${packages[*]} (--no-install-recommends; no service started or enabled):"
printf '  %s\n' "${reasons[@]}"
[ "$mode" = --plan ] && exit 0

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
    echo "os-deps: cannot install ${packages[*]}: not root and no sudo. Install them with your package manager." >&2
    exit 1
  fi
fi

if command -v apt-get >/dev/null 2>&1; then
  policy=/usr/sbin/policy-rc.d
  if [ ! -e "$policy" ]; then
    # Ours only for this run (an existing one is the administrator's and stays as it is).
    $sudo sh -c "printf '#!/bin/sh\n# os-deps.sh: no service starts while it installs\nexit 101\n' > $policy && chmod 0755 $policy"
    trap '$sudo rm -f "$policy"' EXIT
  fi
  before="$(dpkg-query -W -f '${Package}\n' | sort)"
  echo "os-deps: apt-get update"
  $sudo apt-get update -q
  echo "os-deps: apt-get install --no-install-recommends ${packages[*]}"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${packages[@]}"
  added="$(comm -13 <(echo "$before") <(dpkg-query -W -f '${Package}\n' | sort))"
  echo "os-deps: $(echo "$added" | grep -c .) packages added"
  if command -v systemctl >/dev/null 2>&1; then
    units=()
    for pkg in $added; do
      while read -r path; do units+=("$(basename "$path")"); done < <(
        dpkg -L "$pkg" | grep -E '^(/usr)?/lib/systemd/system/[^/@]+\.(service|socket|timer)$' || true
      )
    done
    if [ ${#units[@]} -gt 0 ]; then
      # systemctl disable edits the wants/ links, so it works without a running systemd too.
      $sudo systemctl disable --quiet "${units[@]}" 2>/dev/null || true
      echo "os-deps: left stopped and disabled: ${units[*]}"
    fi
  fi
elif command -v dnf >/dev/null 2>&1; then
  # Fedora names; dnf never starts or enables a package's service. Alertmanager: no Fedora name was
  # checked here (its test skips without it), nor for the RTSP test cameras' packages (their tests skip).
  declare -A fedora=([python3-venv]="" [mosquitto]=mosquitto [gstreamer1.0-tools]=gstreamer1
    [gstreamer1.0-plugins-base]=gstreamer1-plugins-base [gstreamer1.0-plugins-good]=gstreamer1-plugins-good
    [python3-gi]="" [gir1.2-gst-rtsp-server-1.0]="" [gstreamer1.0-plugins-ugly]="" [gstreamer1.0-plugins-bad]=""
    [ffmpeg]=""
    [prometheus]=golang-github-prometheus
    [prometheus-alertmanager]="" [chromium]=chromium [nginx]=nginx [postgresql]="")
  names=()
  for pkg in "${packages[@]}"; do [ -n "${fedora[$pkg]}" ] && names+=("${fedora[$pkg]}"); done
  [ ${#names[@]} -eq 0 ] || $sudo dnf install -y --setopt=install_weak_deps=False "${names[@]}"
else
  echo "os-deps: no apt-get or dnf here: install ${packages[*]} yourself, then run make again." >&2
  exit 1
fi
