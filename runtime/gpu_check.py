"""`python -m runtime.gpu_check`, its documented name: the command is tools/gpu_check.py, beside the runtime."""
import sys

if __name__ == "__main__":
    from tools.gpu_check import main
    sys.exit(main())
