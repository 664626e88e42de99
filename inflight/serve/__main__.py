import sys

from inflight.serve.app import main

if __name__ == "__main__":
    sys.exit(main())
