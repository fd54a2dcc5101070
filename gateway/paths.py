"""Where the project's non-code files live once installed."""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

__all__ = ["schemas_dir"]

#: Where ``[tool.setuptools.data-files]`` in pyproject.toml installs schemas/, relative to the data prefix.
_INSTALLED_SCHEMAS = Path("share") / "dcp-gateway" / "schemas"


def schemas_dir() -> Path:
    """The folder holding the Avro schemas (``*.avsc``).

    A source checkout or editable install (``pip install -e .``) uses ``<repo>/schemas``; a regular install
    (``pip install .``, the Docker image) uses the copy placed under the environment's data prefix.
    Raises FileNotFoundError when neither exists.
    """
    root = Path(__file__).resolve().parent.parent
    candidates: list[Path] = []
    if (
        root / "pyproject.toml"
    ).is_file():  # a checkout, not site-packages (which may hold an unrelated "schemas")
        candidates.append(root / "schemas")
    for prefix in (sysconfig.get_path("data"), sys.prefix, sysconfig.get_path("data", "posix_user")):
        candidate = Path(prefix) / _INSTALLED_SCHEMAS
        if candidate not in candidates:
            candidates.append(candidate)
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"no schemas folder; looked in: {', '.join(str(c) for c in candidates)}")
