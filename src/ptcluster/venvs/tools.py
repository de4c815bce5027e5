"""The uv that builds the environment on the nodes: a wheel like any other, of the head's own uv
version, for the node platform. It travels with the environment, so a node that never ran
``setup`` (a Slurm allocation) has it too.

It comes from the store, a ``--find-links`` folder, the head's own installed uv packed back into
a wheel (when the head's machine is the node's: no download at all; fixed timestamps, so the
same install always gives the same bytes), or pip's download.
"""

from __future__ import annotations

import base64
import hashlib
import os
import platform as host
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

from ptcluster.errors import PtclusterError
from ptcluster.venvs.fetch import from_folders, obtain
from ptcluster.venvs.pins import Pin
from ptcluster.venvs.platforms import best_file
from ptcluster.venvs.resolved import Platform, Wheel
from ptcluster.venvs.store import WheelStore

UV = "uv"
_LEFT_OUT = ("INSTALLER", "REQUESTED", "RECORD", "direct_url.json")


def head_uv_version() -> str:
    from importlib import metadata  # (~9 ms, and email's parser: not in every run's start)

    try:
        return metadata.version(UV)
    except metadata.PackageNotFoundError:
        raise PtclusterError("uv is not installed beside ptcluster on this machine",
                             "reinstall ptcluster (uv is one of its dependencies)") from None


def uv_binary() -> Path:
    """The head's uv executable (the one beside ptcluster)."""
    from uv import find_uv_bin  # the uv package's own lookup of its binary
    return Path(find_uv_bin())


def uv_wheel(platform: Platform, *, find_links: Sequence[Path], store: WheelStore) -> Wheel:
    """The uv wheel for ``platform``, in the store."""
    version = head_uv_version()
    stored = store.find(UV, version)
    best = best_file([w.filename for w in stored], platform)
    if best is not None:
        return next(w for w in stored if w.filename == best)
    pin = Pin(name=UV, version=version)
    found = from_folders(pin, platform, find_links, store, "ptcluster's uv")
    if found is not None:
        return found
    if host.machine() == platform.machine:
        with tempfile.TemporaryDirectory(prefix="ptcluster-uv-") as tmp:
            packed = pack_installed_uv(Path(tmp))
            if packed is not None and best_file([packed.name], platform):
                return store.add(packed)
    return obtain([pin], platform, source="ptcluster's uv", find_links=find_links,
                  store=store, trusted=False)[0]


def pack_installed_uv(dest: Path) -> Path | None:
    """The head's installed uv as a wheel in ``dest`` (None where its files are not all
    there to pack)."""
    from importlib import metadata

    dist = metadata.distribution(UV)
    files = [f for f in dist.files or [] if "__pycache__" not in f.parts]
    dist_info = f"uv-{dist.version}.dist-info"
    wheel_meta = dist.read_text("WHEEL") or ""
    tags = [line.split(":", 1)[1].strip() for line in wheel_meta.splitlines()
            if line.startswith("Tag:")]
    if not tags:
        return None
    members: list[tuple[str, Path]] = []
    for f in files:
        path = Path(str(f.locate()))
        if f.parts[0] == ".." and f.parts[-2] == "bin":  # a script: back to the .data folder
            members.append((f"uv-{dist.version}.data/scripts/{f.name}", path))
        elif f.parts[0] != ".." and f.name not in _LEFT_OUT:
            members.append(("/".join(f.parts), path))
    if not all(p.is_file() for _, p in members):
        return None
    python, abi, plat = (sorted({t.split("-")[i] for t in tags}) for i in range(3))
    name = f"uv-{dist.version}-{'.'.join(python)}-{'.'.join(abi)}-{'.'.join(plat)}.whl"
    record = []
    out = dest / name
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for arcname, path in sorted(members):
            data = path.read_bytes()
            info = zipfile.ZipInfo(arcname, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if os.access(path, os.X_OK) else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{arcname},sha256={digest.decode()},{len(data)}")
        record.append(f"{dist_info}/RECORD,,")
        info = zipfile.ZipInfo(f"{dist_info}/RECORD", date_time=(1980, 1, 1, 0, 0, 0))
        zf.writestr(info, "\n".join(record) + "\n")
    return out
