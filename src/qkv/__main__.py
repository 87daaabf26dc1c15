"""``python -m qkv``: the ``qkv`` command."""
import sys

from .cli import main

sys.exit(main())
