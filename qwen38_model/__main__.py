"""`python -m qwen38_model`: the command line (qwen38_model.cli)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
