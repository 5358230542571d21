"""Shared test settings: offline hubs, quiet tokenizers. Helpers live in ``tests/helpers.py``
(``from tests.helpers import ...``: the checkout's root is on ``sys.path`` under pytest's rootdir)."""

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
