import sys

from kit.run.cli import main

sys.exit(main())
