"""Run ``shmrdv bench`` from a checkout: ``python3 tools/bench.py --quick``."""

import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from shmrdv._bench.runner import main

    raise SystemExit(main())
