#!/usr/bin/env bash
# Installs the OS tools the agent's tests and demo use, when they are missing:
# mosquitto (the broker every test starts), gst-launch-1.0 (the GStreamer camera source) and
# prometheus (the server the metrics tests scrape /metrics with and run the dashboard's queries on).
set -euo pipefail
need=()
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || need+=(mosquitto)
command -v gst-launch-1.0 >/dev/null 2>&1 || need+=(gstreamer1.0-tools gstreamer1.0-plugins-base gstreamer1.0-plugins-good)
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
[ ${#need[@]} -eq 0 ] && exit 0
echo "os-deps: installing ${need[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
    echo "os-deps: cannot install ${need[*]}: not root and no sudo. Install them with your package manager." >&2
    exit 1
  fi
fi
if command -v apt-get >/dev/null 2>&1; then
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}"
elif command -v dnf >/dev/null 2>&1; then
  $sudo dnf install -y mosquitto gstreamer1 gstreamer1-plugins-base gstreamer1-plugins-good golang-github-prometheus
else
  echo "os-deps: no apt-get or dnf here: install ${need[*]} yourself, then run make again." >&2
  exit 1
fi
