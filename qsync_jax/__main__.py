import sys

from qsync_jax.cli import main

sys.exit(main())
