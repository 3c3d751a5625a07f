"""`python -m runtime.batch_bench`, its documented name: the command is tools/batch_bench.py, beside the runtime."""
import sys

if __name__ == "__main__":
    from tools.batch_bench import main
    sys.exit(main())
