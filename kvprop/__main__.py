import sys

from kvprop.cli import main

sys.exit(main())
