"""A tool that trains in a child process, as axolotl (``accelerate launch``), ``trl sft`` and LLaMA-Factory
(``torchrun``) do: it re-launches ``train_tiny.py`` with its own arguments in a new Python process.

``--clear_env``: the child gets an environment with nothing but ``PATH`` (a launcher that drops the
environment), so megatrain's boot cannot reach it.
"""

import os
import subprocess
import sys

if __name__ == "__main__":
    args = sys.argv[1:]
    env = None
    if "--clear_env" in args:
        args.remove("--clear_env")
        env = {"PATH": os.environ.get("PATH", "")}
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_tiny.py")
    sys.exit(subprocess.call([sys.executable, script, *args], env=env))
