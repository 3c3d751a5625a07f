"""`python -m runtime.projection`, its documented name: the command is tools/projection.py, beside the runtime."""
import sys

if __name__ == "__main__":
    from tools.projection import main
    sys.exit(main())
