"""The server's version, as every front reports it (OpenAPI, AllSpark, SGLang, the CLI)."""
from __future__ import annotations

import os
import re
import subprocess
from importlib import metadata


def package_version() -> str:
    """The installed xlaserve version as packaged ("0+unknown" when not installed)."""
    try:
        return metadata.version("xlaserve")
    except Exception:
        return "0+unknown"


def version_string() -> str:
    """MAJOR.MINOR.PATCH of the installed xlaserve."""
    try:
        v = metadata.version("xlaserve")
    except metadata.PackageNotFoundError:
        v = "0.0.0"
    m = re.match(r"\d+\.\d+\.\d+", v)
    return m.group(0) if m else "0.0.0"


def _git_sha() -> str:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                             text=True, timeout=2)
        sha = out.stdout.strip()
        return sha if out.returncode == 0 and sha else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


GIT_SHA = _git_sha()
