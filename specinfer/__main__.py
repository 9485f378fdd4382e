import sys

from specinfer.cli import main

sys.exit(main())
