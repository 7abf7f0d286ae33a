import sys

from memstudy.cli import main

sys.exit(main())
