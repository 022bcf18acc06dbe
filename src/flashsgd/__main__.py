import sys

from flashsgd.cli import main

sys.exit(main())
