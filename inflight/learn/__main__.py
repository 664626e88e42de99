import sys

from inflight.learn.app import main

if __name__ == "__main__":
    sys.exit(main())
