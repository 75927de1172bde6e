"""`python -m perinstance`: the `perinstance` command (perinstance/cli/main.py)."""

from perinstance.cli.main import main

if __name__ == "__main__":
    main()
