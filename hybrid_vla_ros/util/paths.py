"""Where the package's own files are: the source tree's, else a colcon install's ``<prefix>/share/hybrid_vla_ros``.
Nothing here imports ROS: the ament index is a folder tree, read directly.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

PACKAGE = "hybrid_vla_ros"
#: The repository root of a source checkout (the folder holding ``package.xml`` and ``hybrid_vla_ros/``).
REPO_ROOT = Path(__file__).resolve().parents[2]


def share_directory(package: str) -> Path:
    """``<prefix>/share/<package>`` of the first ``AMENT_PREFIX_PATH`` prefix whose ament index registers it (as
    ``ament_index_python.get_package_share_directory``), else of ``sys.prefix`` if there. LookupError otherwise."""
    prefixes = [p for p in os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep) if p]
    for prefix in prefixes:
        marker = Path(prefix) / "share" / "ament_index" / "resource_index" / "packages" / package
        if marker.is_file():
            return Path(prefix) / "share" / package
    candidate = Path(sys.prefix) / "share" / package
    if candidate.is_dir():
        return candidate
    raise LookupError(f"package {package!r} is not installed (not in the ament index of AMENT_PREFIX_PATH, "
                      f"no share/{package} under {sys.prefix})")


def package_file(*parts: str) -> Path:
    """A file or folder shipped with the package (``config/...``, ``data/...``): the source tree's, else the
    installed copy, else the (missing) source-tree path."""
    local = REPO_ROOT.joinpath(*parts)
    if local.exists():
        return local
    try:
        installed = share_directory(PACKAGE).joinpath(*parts)
    except LookupError:
        return local
    return installed if installed.exists() else local


def embedded_bag() -> Path:
    """The DGP 6-camera MCAP bag shipped in ``data/`` (see its SOURCE.txt): source tree or installed copy."""
    return package_file("data", "dgp_scene02_6cam_mcap")


#: Environment variable that overrides :func:`cache_dir`.
CACHE_ENV = "HYBRID_VLA_CACHE"


def cache_dir() -> Path:
    """Folder for reusable build artifacts: ``$HYBRID_VLA_CACHE``, else ``$XDG_CACHE_HOME/hybrid_vla_ros``, else
    ``~/.cache/hybrid_vla_ros`` (not created)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / PACKAGE


def output_file_problem(path: str | os.PathLike, create_parents: bool = False) -> str:
    """Why a file cannot be written at ``path`` (a folder, read-only, its folder missing or not writable), checked
    before any work; ``""`` when it can. ``create_parents``: judge the folder by :func:`output_dir_problem`."""
    p = Path(path)
    if p.is_dir():
        return f"{p} is a folder, not a file"
    if p.exists() and not os.access(p, os.W_OK):
        return f"{p} is not writable"
    folder = p.parent if str(p.parent) else Path(".")
    if create_parents:
        return output_dir_problem(folder)
    if not folder.exists():
        return f"the folder {folder} does not exist"
    if not folder.is_dir():
        return f"{folder} is not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the folder {folder} is not writable"
    return ""


def output_dir_problem(path: str | os.PathLike) -> str:
    """Why a folder cannot be used (or created, with its parents) at ``path`` for output; ``""`` when it can (a
    writable folder, or its nearest existing ancestor is one)."""
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            return f"{p} is not a folder"
        return "" if os.access(p, os.W_OK | os.X_OK) else f"the folder {p} is not writable"
    ancestor = p.absolute().parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"cannot create the folder {p}: {ancestor} is not a folder"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"cannot create the folder {p}: {ancestor} is not writable"
    return ""
