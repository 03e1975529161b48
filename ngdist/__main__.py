import sys

from ngdist.cli import main

sys.exit(main())
