"""`python -m infer.serve ...`: `infer serve ...` (the server's own entry point, as vLLM's api_server module is)."""

import sys

from infer.cli.main import main

if __name__ == "__main__":
    sys.argv[1:1] = ["serve"]
    main()
