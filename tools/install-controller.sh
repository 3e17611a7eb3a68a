#!/usr/bin/env bash
# Installs the fleet controller's system part on an operator host, as systemd/edge-fleet-controller.service
# needs it: docs/controller-install.md says when to run it; tests/test_install_controller.py runs it
# against a temporary root and checks every owner and mode below.
#
#   sudo tools/install-controller.sh [--key-id ID] [--edge-agent CMD] [--root DIR]
#
#   user and group edge-fleet-controller     system account, no login, no home
#   /etc/edge-fleet-controller/              root:edge-fleet-controller 0750 (systemd's
#                                            ConfigurationDirectory= creates it root:root, which
#                                            the service could not read)
#     controller.yaml                        root:edge-fleet-controller 0640, from configs/controller.yaml
#     ID.key                                 edge-fleet-controller 0600: the controller refuses a key
#                                            others can read; made by `edge-agent fleet keygen`
#     ID.pub                                 root 0644: what the devices trust
#     console.token                          edge-fleet-controller 0600: random, made here
#   /etc/systemd/system/edge-fleet-controller.service
#   /opt/edge-agent/docs/                    the unit's Documentation= (pip installs no docs)
#
# Files that exist are kept (a signing key is never replaced); their owners and modes are set again.
# /var/lib/edge-fleet-controller is the unit's StateDirectory=: systemd creates it, owned by the user.
# --root DIR installs under DIR instead of / (useradd --prefix; an empty DIR gets etc/passwd, group,
# shadow and gshadow with root alone) and runs no systemctl. --edge-agent CMD is the command that
# runs `fleet keygen` (default: the venv's), e.g. "python3 -m agent" from a checkout.
# Every check comes first: a run that stops changed nothing.
set -euo pipefail

usage="usage: $0 [--key-id ID] [--edge-agent CMD] [--root DIR]"
root=""
key_id="fleet-$(date -u +%Y)"
edge_agent="/opt/edge-agent/.venv/bin/edge-agent"
while [ $# -gt 0 ]; do
  case "$1" in
    --root) root="${2%/}"; shift 2 ;;
    --key-id) key_id="$2"; shift 2 ;;
    --edge-agent) edge_agent="$2"; shift 2 ;;
    -h | --help) echo "$usage"; exit 0 ;;
    *) echo "install-controller: unknown argument $1; $usage" >&2; exit 2 ;;
  esac
done
read -ra keygen <<<"$edge_agent"
repo="$(cd "$(dirname "$0")/.." && pwd)"
user=edge-fleet-controller
etc_dir=/etc/$user # as the unit and controller.yaml name it
etc="$root$etc_dir" # where this run writes it
conf="$etc/controller.yaml"

# Everything this run needs is checked before anything is changed: a run that stops half-way would
# leave a user and a controller.yaml behind that the next run keeps as they are.
problems=()
if [ "$(id -u)" -ne 0 ]; then
  problems+=("run it as root (sudo): it creates a system user and files owned by it")
fi
if [ -n "$root" ] && [ ! -d "$root" ]; then
  problems+=("--root $root is not a directory: make it first (an empty one will do)")
fi
for needed in configs/controller.yaml "systemd/$user.service" docs; do
  [ -e "$repo/$needed" ] || problems+=("$repo/$needed is missing: run the script from a full checkout")
done
if [[ ! "$key_id" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$ ]]; then
  problems+=("--key-id $key_id: 1-64 letters, digits, '_', '.', '-', starting with a letter or digit")
fi
if ! grep -qs "^$user:" "$root/etc/passwd" && ! command -v useradd >/dev/null; then
  problems+=("useradd is not installed (it makes the user $user): install the passwd package")
fi
if [ -e "$conf" ]; then
  key_path="$(awk '$1 == "signing_key:" { print $2 }' "$conf")"
else
  key_path="$etc_dir/$key_id.key"
fi
if [ -n "$key_path" ] && [ "$key_path" != null ] && [ ! -e "$root$key_path" ] &&
  ! "${keygen[@]}" fleet keygen --help >/dev/null 2>&1; then
  problems+=("cannot run '$edge_agent fleet keygen' (it makes the signing key $key_path): install the code first (docs/controller-install.md, step 1) or name the command with --edge-agent CMD")
fi
if [ ${#problems[@]} -gt 0 ]; then
  for problem in "${problems[@]}"; do echo "install-controller: $problem" >&2; done
  echo "install-controller: nothing was changed" >&2
  exit 1
fi

say() { echo "install-controller: $*"; }

if [ -n "$root" ] && [ ! -f "$root/etc/passwd" ]; then
  # An empty root gets the account files useradd --prefix edits, with root alone in them.
  install -d -m 0755 "$root/etc"
  for seed in "passwd 0644 root:x:0:0:root:/root:/bin/bash" "group 0644 root:x:0:" \
    "shadow 0640 root:*:20000:0:99999:7:::" "gshadow 0640 root:*::"; do
    read -r name mode line <<<"$seed"
    [ -e "$root/etc/$name" ] || { echo "$line" >"$root/etc/$name" && chmod "$mode" "$root/etc/$name"; }
  done
  say "$root has no etc/passwd: made etc/passwd, group, shadow and gshadow with root alone"
fi
if grep -q "^$user:" "$root/etc/passwd"; then
  say "user $user exists"
else
  prefix=()
  [ -z "$root" ] || prefix=(--prefix "$root")
  useradd "${prefix[@]}" --system --user-group --no-create-home --home-dir "/var/lib/$user" \
    --shell /usr/sbin/nologin "$user"
  say "created system user and group $user"
fi
# Numbers, not names: under --root the user is in DIR/etc/passwd, unknown to this system's chown.
uid="$(awk -F: -v u="$user" '$1 == u { print $3 }' "$root/etc/passwd")"
gid="$(awk -F: -v u="$user" '$1 == u { print $4 }' "$root/etc/passwd")"

install -d -m 0750 -o 0 -g "$gid" "$etc"
say "$etc_dir: root:$user 0750"

if [ -e "$conf" ]; then
  say "$etc_dir/controller.yaml exists: kept (its signing_key is the key below)"
else
  staged="$(mktemp)"
  trap 'rm -f "$staged"' EXIT
  sed -e "s|^signing_key: .*|signing_key: $key_path|" \
    -e "s|^key_id: .*|key_id: $key_id|" \
    -e "s|^  token_file: null|  token_file: $etc_dir/console.token|" \
    "$repo/configs/controller.yaml" >"$staged"
  install -m 0640 -o 0 -g "$gid" "$staged" "$conf"
  say "wrote $etc_dir/controller.yaml from configs/controller.yaml (key id $key_id): edit its mqtt: section"
fi
chown "0:$gid" "$conf"
chmod 0640 "$conf"

if [ -n "$key_path" ] && [ "$key_path" != null ]; then
  key="$root$key_path"
  if [ -e "$key" ]; then
    say "$key_path exists: kept"
  else
    key_dir="$(dirname "$key")"
    name="$(basename "$key" .key)"
    "${keygen[@]}" fleet keygen --out "$key_dir" --key-id "$name" | sed 's/^/  /'
  fi
  chown "$uid:$gid" "$key"
  chmod 0600 "$key"
  pub="${key%.key}.pub"
  if [ -e "$pub" ]; then
    chown 0:0 "$pub"
    chmod 0644 "$pub"
  fi
  say "$key_path: $user 0600 (trust ${pub#"$root"} on the devices: docs/fleet.md, step 1)"
fi

token="$etc/console.token"
if [ -e "$token" ]; then
  say "$etc_dir/console.token exists: kept"
else
  (umask 077 && head -c 32 /dev/urandom | base64 >"$token")
  say "made a console token: $etc_dir/console.token (docs/console.md, The token)"
fi
chown "$uid:$gid" "$token"
chmod 0600 "$token"

install -D -m 0644 "$repo/systemd/$user.service" "$root/etc/systemd/system/$user.service"
install -d -m 0755 "$root/opt/edge-agent/docs"
cp -R "$repo/docs/." "$root/opt/edge-agent/docs/"
say "installed /etc/systemd/system/$user.service and its Documentation= in /opt/edge-agent/docs"

if [ -z "$root" ]; then
  systemctl daemon-reload
fi
cat <<EOF
install-controller: next:
  1. edit $etc_dir/controller.yaml: mqtt: (broker, account); the broker password file and CA as
     sudo install -m 0600 -o $user -g $user mqtt.password $etc_dir/
     sudo install -m 0644 ca.pem $etc_dir/
  2. sudo systemctl enable --now $user && journalctl -u $user -f
EOF
