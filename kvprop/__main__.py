import sys

from kvprop.front.cli import main

sys.exit(main())
