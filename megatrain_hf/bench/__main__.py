"""``python -m megatrain_hf.bench ...``: the same as ``megatrain bench ...``."""

import logging
import sys

from . import main

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(main())
