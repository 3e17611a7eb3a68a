#!/usr/bin/env bash
# Runs tools/os-deps.sh for real, with apt-get, on a throwaway copy of this machine, to check what it
# installs and that it leaves no service started or enabled. This machine is not changed.
#
#   sudo tools/os-deps-sandbox.sh demo|test [PACKAGE...]
#
# A private mount and PID namespace (unshare) lays an overlay on / whose writes go to a tmpfs, and
# chroots into it with its own /proc (no process outside is visible, so no package script can stop
# one). There the PACKAGEs are purged first, as on a machine that never had them (with a policy-rc.d
# in place, so their removal stops nothing), the overlay's own policy-rc.d is removed, and
# `tools/os-deps.sh TARGET` runs. Exit 1 when a unit of a package it added is enabled afterwards, or
# its policy-rc.d was left behind. Everything vanishes with the namespace.
#
# The README's "no service is left running or enabled" was checked with
#   sudo tools/os-deps-sandbox.sh test mosquitto nginx nginx-common nginx-light prometheus
# on the Debian 12 development machine: 36 packages added, mosquitto, nginx and prometheus units
# "disabled", start denied by the policy while installing.
set -euo pipefail
if [ "${1:-}" != --inside ]; then
  case "${1:-}" in demo | test) ;; *) echo "usage: $0 demo|test [PACKAGE...]" >&2; exit 2 ;; esac
  [ "$(id -u)" -eq 0 ] || { echo "os-deps-sandbox: needs root (mount namespaces, chroot)" >&2; exit 1; }
  work="$(mktemp -d /tmp/os-deps-sandbox.XXXXXX)" # an empty mount point, here and after
  rc=0
  SANDBOX_DIR="$work" unshare --mount --pid --fork --propagation private "$0" --inside "$@" || rc=$?
  rmdir "$work"
  exit "$rc"
fi
shift
target="$1"
shift
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$SANDBOX_DIR"
mount -t tmpfs -o size=4g tmpfs "$work"
mkdir -p "$work/upper" "$work/work" "$work/root"
root="$work/root"
mount -t overlay overlay -o "lowerdir=/,upperdir=$work/upper,workdir=$work/work" "$root"
mount -t proc proc "$root/proc"
mount --bind /dev "$root/dev"
mount --bind /dev/pts "$root/dev/pts"
mount --bind /sys "$root/sys"
mkdir -p "$root/repo"
mount --bind -o ro "$repo" "$root/repo"

# shellcheck disable=SC2016  # expanded inside the chroot
chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin TARGET="$target" /bin/bash -c '
set -euo pipefail
if [ $# -gt 0 ]; then
  printf "#!/bin/sh\nexit 101\n" >/usr/sbin/policy-rc.d && chmod 0755 /usr/sbin/policy-rc.d
  echo "os-deps-sandbox: purging $*"
  DEBIAN_FRONTEND=noninteractive apt-get purge -y -q "$@" >/dev/null
fi
rm -f /usr/sbin/policy-rc.d
before="$(dpkg-query -W -f "\${Package}\n" | sort)"
/repo/tools/os-deps.sh "$TARGET"
added="$(comm -13 <(echo "$before") <(dpkg-query -W -f "\${Package}\n" | sort))"
bad=0
for pkg in $added; do
  for unit in $(dpkg -L "$pkg" | grep -E "^(/usr)?/lib/systemd/system/[^/@]+\.(service|socket|timer)$" || true); do
    state="$(systemctl is-enabled "$(basename "$unit")" 2>&1 || true)"
    echo "os-deps-sandbox: $pkg $(basename "$unit"): $state"
    [ "$state" = enabled ] && bad=1
  done
done
if [ -e /usr/sbin/policy-rc.d ]; then echo "os-deps-sandbox: policy-rc.d left behind"; bad=1; fi
echo "os-deps-sandbox: $(echo "$added" | grep -c . || true) packages added; $([ $bad -eq 0 ] && echo ok || echo FAILED)"
exit $bad
' sandbox "$@"
