import sys

from inflight.run.app import main

if __name__ == "__main__":
    sys.exit(main())
