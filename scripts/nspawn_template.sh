#!/usr/bin/env bash
# The root file system the systemd-nspawn testbed nodes boot (tests/support/nspawn.py), built
# once and cached (as root, network allowed: this is install time, like prepare_testbed.sh).
#   $PTC_TESTBED_CACHE/nspawn/root/   debootstrap --variant=minbase bookworm with systemd as init,
#                                     dbus, sshd, iproute2, python3 (+ -dev, build-essential:
#                                     what `ptcluster setup` checks for), an empty machine-id
#   .../root/srv/ptc-apt/             a `file:` apt repository, the node's only apt source: what
#                                     setup installs there offline (python3-venv, rsync, munge,
#                                     slurmd, slurmctld, slurm-client and their dependencies;
#                                     ufw, for a node whose firewall is on)
# Idempotent: a complete template (its stamp names this recipe's version) is kept.
# Facts it relies on: ../shared/TESTBED.md, "Machines with systemd" (measured 2026-12-02).
set -euo pipefail
CACHE="${PTC_TESTBED_CACHE:-/var/cache/ptcluster-testbed}"
DIR="$CACHE/nspawn"
ROOT="$DIR/root"
RECIPE="4"  # bump when what follows changes: the cached template is rebuilt
MIRROR="${PTC_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
if [ -f "$DIR/.complete" ] && [ "$(cat "$DIR/.complete")" = "$RECIPE" ]; then
  exit 0
fi
for tool in debootstrap systemd-nspawn dpkg-scanpackages; do
  command -v "$tool" >/dev/null || { echo "nspawn_template: $tool missing (scripts/test.sh installs it)" >&2; exit 1; }
done
mkdir -p "$DIR"
exec 9>"$DIR/.lock"
flock 9  # two test runs at once build it once
if [ -f "$DIR/.complete" ] && [ "$(cat "$DIR/.complete")" = "$RECIPE" ]; then
  exit 0
fi
rm -rf "$ROOT" "$DIR/.complete"
debootstrap --variant=minbase \
  --include=systemd,systemd-sysv,dbus,openssh-server,iproute2,python3,python3-dev,build-essential \
  bookworm "$ROOT" "$MIRROR" >"$DIR/debootstrap.log" 2>&1 \
  || { tail -20 "$DIR/debootstrap.log" >&2; exit 1; }
# The packages setup installs on a node, downloaded here (the chroot has this machine's network)
# into a local repository inside the template: the nodes themselves have no network.
printf 'deb %s bookworm main\n' "$MIRROR" > "$ROOT/etc/apt/sources.list"
rm -f "$ROOT"/var/cache/apt/archives/*.deb  # debootstrap's own: installed already
chroot "$ROOT" apt-get update -q >/dev/null
chroot "$ROOT" apt-get install -q -y --download-only --no-install-recommends \
  python3-venv rsync munge slurmd slurmctld slurm-client ufw >/dev/null
mkdir -p "$ROOT/srv/ptc-apt"
mv "$ROOT"/var/cache/apt/archives/*.deb "$ROOT/srv/ptc-apt/"
(cd "$ROOT/srv/ptc-apt" && dpkg-scanpackages . /dev/null 2>/dev/null | gzip -9 > Packages.gz)
printf 'deb [trusted=yes] file:/srv/ptc-apt ./\n' > "$ROOT/etc/apt/sources.list"
rm -rf "$ROOT"/var/lib/apt/lists/*
# Every clone gets its own machine-id at boot from an empty file (a copied one would be shared).
: > "$ROOT/etc/machine-id"
rm -f "$ROOT/var/lib/dbus/machine-id"
ln -s /etc/machine-id "$ROOT/var/lib/dbus/machine-id"
chroot "$ROOT" systemctl enable systemd-networkd ssh >/dev/null 2>&1
# no login prompt on the console (nobody reads it), no wait for a network that is there at once
chroot "$ROOT" systemctl mask console-getty.service systemd-networkd-wait-online.service >/dev/null 2>&1
mkdir -p "$ROOT/root/.ssh"
chmod 700 "$ROOT/root/.ssh"
sed -i 's/^#\?PermitRootLogin.*/PermitRootLogin prohibit-password/' "$ROOT/etc/ssh/sshd_config"
rm -f "$ROOT"/etc/ssh/ssh_host_*  # each node gets its own, written before it boots
du -sm "$ROOT" | cut -f1 > "$DIR/size_mb"
echo "$RECIPE" > "$DIR/.complete"
echo "nspawn template: $ROOT ($(cat "$DIR/size_mb") MB)"
