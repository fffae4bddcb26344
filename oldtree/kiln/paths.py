"""Where kiln keeps what it makes: ``$KILN_HOME``, else ``~/.cache/kiln`` (converted models under
``models/``, compiled artifacts under ``artifacts/``)."""

from __future__ import annotations

import os
from pathlib import Path


def kiln_home() -> Path:
    return Path(os.environ.get("KILN_HOME") or Path.home() / ".cache" / "kiln").expanduser()
