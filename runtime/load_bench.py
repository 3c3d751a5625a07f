"""`python -m runtime.load_bench`, its documented name: the command is tools/load_bench.py, beside the runtime."""
import sys

if __name__ == "__main__":
    from tools.load_bench import main
    sys.exit(main())
