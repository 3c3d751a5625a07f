"""`python -m runtime.acceptance`, its documented name: the command is tools/acceptance.py, beside the runtime."""
import sys

if __name__ == "__main__":
    from tools.acceptance import main
    sys.exit(main())
