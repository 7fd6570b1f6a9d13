"""The texts the fixture and corpus makers speak, as data: one JSON file each beside this module, whose "about"
entry says what its lists hold. Every sentence was written for this project and is in the public domain (CC0)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TEXTS_DIR = Path(__file__).resolve().parent


def load(name: str) -> dict[str, Any]:
    """The data of TEXTS_DIR/NAME.json (its "about" entry included)."""
    return json.loads((TEXTS_DIR / f"{name}.json").read_text(encoding="utf-8"))
