"""python -m rayflex.chaos --mode overlap --seed 1 2 3 --faults 16"""

import sys

from rayflex.testing.chaos.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
