import sys

from kit.runner import main

sys.exit(main())
