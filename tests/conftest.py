"""Shared test settings: offline hubs, quiet tokenizers. Helpers live in ``tests/helpers.py``
(``from tests.helpers import ...``: the checkout's root is on ``sys.path`` under pytest's rootdir)."""

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_addoption(parser):
    parser.addoption(
        "--fast", action="store_true",
        help="one case of each parametrized test (its first parameter set): the `make test-fast` loop",
    )


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--fast"):
        return
    seen, kept, dropped = set(), [], []
    for item in items:
        key = (item.nodeid.split("[", 1)[0])
        (dropped if key in seen else kept).append(item)
        seen.add(key)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
