"""``python -m harel_store``: the ``harel-store`` command."""

from __future__ import annotations

import sys

from harel_store.cli import main

sys.exit(main())
