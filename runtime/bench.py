"""`python -m runtime.bench`, its documented name: the command is tools/bench.py, beside the runtime."""
import sys

if __name__ == "__main__":
    from tools.bench import main
    sys.exit(main())
