import sys

from kit.cli.main import main

sys.exit(main())
