"""`python -m infer ...`: the `infer` command."""

from infer.cli.main import main

if __name__ == "__main__":
    main()
