import sys

from qsync_cli.main import main

sys.exit(main())
